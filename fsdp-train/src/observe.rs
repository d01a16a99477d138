//! What watches a run on rank 0: the console (progress bar or step lines, `--metrics`), wrapped
//! by the TensorBoard writer with `--tensorboard` — assembled before training, closed after it.

use std::io::IsTerminal;

use crate::cli::Cli;
use crate::job::{CudaLaunch, Observer, TrainConfig};
use crate::probe::Probe;
use crate::report::{self, Console};
use crate::resolve::Exit;
use crate::tensorboard;

/// The observer of a run: rank 0's console (`primary`: this process prints and writes the
/// outputs) with `--metrics` (appended to with `--resume`, replaced with `--overwrite`:
/// `paths::check_existing` refused anything else that holds earlier lines), step lines every
/// `--log-every` steps (default: a twelfth of the run), a progress bar only on a terminal, and
/// `--tensorboard`'s event files (their MFU scalar when the GEMM `probe` ran before training).
pub fn observer(
    cli: &Cli,
    c: &TrainConfig,
    primary: bool,
    probe: Option<&Probe>,
    params: u64,
) -> Result<Box<dyn Observer>, Exit> {
    let metrics = match cli.logging.metrics.as_ref().filter(|_| primary) {
        Some(p) => Some((
            p.clone(),
            report::open_metrics(p, c.resume && !cli.logging.overwrite).map_err(Exit::error)?,
        )),
        None => None,
    };
    let every = cli
        .logging
        .log_every
        .map_or((c.steps / 12).max(1), |n| n as usize);
    let launched = c.mpi || c.cuda == Some(CudaLaunch::Processes);
    let progress = primary
        && report::wants_progress_bar(
            std::io::stdout().is_terminal(),
            std::io::stderr().is_terminal(),
            cli.logging.no_progress,
            launched,
        );
    let console = Console::new(progress, every, metrics);
    Ok(match cli.logging.tensorboard.as_ref().filter(|_| primary) {
        Some(dir) => {
            let w = tensorboard::EventWriter::create(dir)
                .map_err(|e| Exit::error(format!("--tensorboard: {e}")))?;
            println!("tensorboard: {}", w.path().display());
            let mfu = probe.map(|p| tensorboard::MfuBasis::new(&*c.model, params, p.flops_per_s));
            Box::new(tensorboard::TensorBoard::new(Box::new(console), w, mfu))
        }
        None => Box::new(console),
    })
}

/// Closes `observer` after the last step (flushes `--metrics` and the event files).
pub fn finish(observer: &mut dyn Observer) -> Result<(), Exit> {
    observer.finish().map_err(|e| {
        Exit::error(if e.starts_with("--tensorboard") {
            e
        } else {
            format!("--metrics: {e}")
        })
    })
}
