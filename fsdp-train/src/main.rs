//! Trains a GPT with FSDP on CPU thread ranks — fsdp-rs's main job.
//!
//! ```sh
//! cargo run --release --bin train_gpt                       # 4 ranks, FullShard, GPT-mini
//! cargo run --release --bin train_gpt -- --strategy no-shard --steps 10 --json
//! cargo run --release --bin train_gpt -- --data input.txt --steps 300 --eval-every 100 \
//!     --metrics m.jsonl --plot loss.svg
//! cargo build --release -p fsdp-train --features mpi --bin train_gpt &&
//!     mpirun -n 4 target/release/train_gpt --backend mpi   # one process per rank (as root:
//!                                                          # mpirun --allow-run-as-root …)
//! ```
//!
//! A run is four steps, one function each below: **parse** the command line ([`cli`]),
//! **resolve** it into the configuration it trains with ([`resolve`]: checks, `--init-from`,
//! `--tokenizer`, `--plan --apply`), **run** it ([`train::run_job`]: every rank of this
//! process — a thread, an MPI process or a GPU ([`cuda`]) — builds the same GPT from the same
//! seed, wraps it with `Fsdp::wrap`, one unit per `Block`, and trains on its own micro-batches
//! from [`data`], checkpointing through [`ckpt`]), and **report** it ([`report`](mod@report): banner, step
//! lines, summary, `--json`; [`kernel_times`]).

// First, so that its never-panicking `print!`/`println!`/`eprintln!` shadow the standard ones in
// every module below (issue #37, 9: a closed stdout must not stop training).
#[macro_use]
mod out;

mod ckpt;
mod cleanup;
mod cli;
#[cfg(test)]
mod cli_doc;
mod cuda;
mod data;
mod hf;
mod input;
mod interop;
mod job;
mod kernel_times;
mod lock;
mod model;
mod observe;
mod optim;
mod paths;
mod plan;
mod probe;
mod report;
mod resolve;
mod sample;
mod tensorboard;
mod tokenizer;
mod train;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;

use crate::cli::Cli;
use crate::job::{Report, TrainConfig};
use crate::probe::Probe;
use crate::report::GemmRate;
use crate::resolve::{Exit, Resolved};

fn main() -> ExitCode {
    // `train_gpt sample …`: generation (module `sample`), its own flags.
    // OS strings: a non-UTF-8 argument is clap's to report (one line, exit 2), never a panic.
    if std::env::args_os().nth(1).is_some_and(|a| a == "sample") {
        return sample_main();
    }
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => return resolve::parse_failure("train_gpt", e),
    };
    // The reference BLAS loads before any thread starts (it sets OPENBLAS_CORETYPE while it
    // loads); a missing library is reported in the summary, not here.
    if cli.parallel.device == cli::DeviceArg::Cpu {
        let _ = probe::load_reference();
    }
    let outcome = resolve::resolve(&cli).and_then(|job| match job {
        Some(job) => run(&cli, job).and_then(|done| report(&cli, done)),
        None => Ok(()),
    });
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => e.exit("train_gpt"),
    }
}

/// A finished run, for [`report()`].
struct Done {
    config: TrainConfig,
    report: Report,
    wall: f64,
    /// The GEMM probe if it ran before training (CPU ranks, `--plan`).
    probe: Option<Probe>,
    /// The model's own parameter count.
    params: u64,
    /// The outputs' locks, held until the last output (`--plot`) is written.
    _locks: paths::Locks,
}

/// Prints the banner and trains: the GEMM probe first on CPU ranks, each rank's matmul threads,
/// the data set, rank 0's console (progress bar or step lines, `--metrics`). `None` for the
/// other processes of a multi-process job (rank 0 reports).
fn run(cli: &Cli, job: Resolved) -> Result<Option<Done>, Exit> {
    let Resolved {
        config: c,
        probe,
        primary,
        locks,
    } = job;
    let cores = resolve::cores();
    // On CUDA the probe runs after training: the CUDA kernel backend is cached per device id,
    // and its first user's device would otherwise be the probe's.
    let probe = match (probe, c.cuda) {
        // `--steps 0` converts: nothing to measure.
        (None, None) if c.steps > 0 => Some(resolve::gemm_probe(&c)?),
        (probe, _) => probe,
    };
    // Ranks share the machine's cores: give each rank's matmuls an even share (unless
    // --matmul-threads says otherwise).
    let threads = cli
        .parallel
        .matmul_threads
        .map_or((cores / c.ranks).max(1), |t| t as usize);
    fsdp_autograd::kernels::cpu::set_matmul_threads(threads);
    let params = c.model.params();
    let data = train::open_data(&c).map_err(Exit::error)?;
    if primary {
        let banner = report::banner(&c, &data.describe(), cores, threads, params);
        println!("{banner}");
    }
    let observer = observe::observer(cli, &c, primary, probe.as_ref(), params)?;
    let start = Instant::now();
    let mut rep = train::run_job(&c, observer, false).map_err(Exit::error)?;
    let wall = start.elapsed().as_secs_f64();
    observe::finish(&mut *rep.observer)?;
    // Another process of a multi-process job: rank 0 reports.
    Ok((rep.rank == 0).then_some(Done {
        config: c,
        report: rep,
        wall,
        probe,
        params,
        _locks: locks,
    }))
}

/// Rank 0's outputs after training: `--plot`, `--kernel-times`, the summary and `--json`.
fn report(cli: &Cli, done: Option<Done>) -> Result<(), Exit> {
    // The locks (`d._locks`) are held until `d` drops at the end.
    let Some(d) = done else { return Ok(()) };
    let (c, rep) = (&d.config, &d.report);
    if let Some(p) = &cli.logging.plot {
        report::plot(p, &rep.history).map_err(Exit::error)?;
        println!("plot: {}", p.display());
    }
    if c.steps == 0 {
        println!("--steps 0: converted without training");
        return Ok(());
    }
    if rep.steps.is_empty() {
        let (done, steps) = (rep.first_step - 1, c.steps);
        println!("nothing to do: the checkpoint is at step {done} of --steps {steps}");
        return Ok(());
    }
    let probe = match d.probe {
        Some(p) => p,
        None => resolve::gemm_probe(c)?,
    };
    if cli.logging.kernel_times {
        if let Some(p) = &cli.logging.profile {
            kernel_times::print(p).map_err(Exit::error)?;
        }
    }
    // The honest limit beside the probe (CPU runs with OpenBLAS installed), measured now that
    // training is over and the machine is quiet.
    let reference = probe::reference_limit(c, resolve::cores(), Duration::from_millis(300));
    let gemm = GemmRate {
        flops_per_s: probe.flops_per_s,
        device: &probe.device,
        dtype: probe.dtype,
        reference: &reference,
    };
    report::summary(c, rep, d.wall, &gemm, d.params, cli.logging.json);
    Ok(())
}

/// `train_gpt sample …` (module [`sample`]).
fn sample_main() -> ExitCode {
    let cli = match sample::SampleCli::try_parse_from(std::env::args_os().skip(1)) {
        Ok(c) => c,
        Err(e) => return resolve::parse_failure("train_gpt sample", e),
    };
    match sample::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => Exit::error(e).exit("train_gpt sample"),
    }
}
