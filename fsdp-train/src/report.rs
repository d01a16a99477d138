//! Output: the banner, the progress bar or plain step lines, the `--metrics` JSON-lines file,
//! the `--plot` picture, and the summary with its `--json` line.
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
//! `--json`'s `backend` names the collective backend the ranks ran on (`thread`, `mpi`,
//! `nccl-threads`, `nccl`, `shared-gpu`: fsdp-collectives' `CollectiveBackend::name`).
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
//! It is printed next to the unsharded state `S = 4Ψ·(2 + optimizer slots)` and `S/F`, where the
//! slots are those the optimizer keeps (`ShardedOptimizer::state_slots`).
//!
//! ## Model FLOP/s
//! `6·Ψ` per token for the parameters (forward 2, backward 4) plus `12·L·d·T` per token for the
//! attention score and value products (`L` layers, width `d`, sequence `T`), times the tokens
//! per second; next to the GEMM rate of a ~0.2 s probe at start-up on the device the model trains
//! on, at its precision (module `probe`: f32 on all cores for CPU ranks; with `--device cuda`
//! the GPU's matmuls in f32 or the mixed-precision dtype); `--json` names the probe's device
//! (`gemm_probe_device`: `"cpu"` or `"cuda:0"`) and dtype (`gemm_probe_dtype`).
//!
//! The `reference` line is the honest limit: the same model FLOP/s over the f32 GEMM rate of
//! OpenBLAS on all cores, measured after training (module `probe`, `reference_limit`), with the
//! CPU kernels' instruction-set level (`FSDP_CPU_ISA`). `--json`: `gemm_reference_flops_per_s`,
//! `model_flops_over_reference_gemm` (both `null` for `--device cuda` runs or without OpenBLAS),
//! `gemm_reference` (the library and its kernels), `gemm_reference_note` (why there is no rate,
//! else `null`) and `cpu_isa`.

use std::fs::File;
use std::io::{LineWriter, Write};
use std::path::{Path, PathBuf};

use fsdp_alloc::DType;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use plotters::prelude::*;
use serde_json::{json, Value};

use fsdp_core::{BackwardPrefetch, Quantization, ShardOver};

use crate::job::TrainConfig;
use crate::job::{prefetch_name, strategy_name, Observer, Report, StepRecord};
use crate::probe::ReferenceProbe;

/// `1234567` → `1,234,567`.
pub fn thousands(n: u64) -> String {
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

/// Bytes as MiB.
pub fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

/// The step line of the plain output.
pub fn step_line(r: &StepRecord) -> String {
    let mut line = format!(
        "step {:>3} | loss {:.3} | {} tok/s | peak {:.1} MiB/rank | ag {:.1} MiB rs {:.1} MiB",
        r.step,
        r.loss,
        thousands(r.tokens_per_s.round() as u64),
        mib(r.peak_allocated),
        mib(r.ag),
        mib(r.rs),
    );
    if r.ar > 0 {
        line.push_str(&format!(" ar {:.1} MiB", mib(r.ar)));
    }
    if let Some(v) = r.val_loss {
        line.push_str(&format!(" | val loss {v:.3}"));
    }
    line
}

/// Whether rank 0 draws a progress bar: both stdout and stderr are terminals, `--no-progress`
/// was not given, and the ranks are not processes under a launcher (`launched`: `--backend mpi`
/// or `nccl`). A launcher forwards a rank's output through its own pipes or pseudo-terminal
/// (OpenMPI gives each rank's stdout a pseudo-terminal even when `mpirun`'s own output goes to a
/// file), so a rank cannot tell where its lines end up: there, plain step lines, never escape
/// codes.
pub fn wants_progress_bar(
    stdout_tty: bool,
    stderr_tty: bool,
    no_progress: bool,
    launched: bool,
) -> bool {
    stdout_tty && stderr_tty && !no_progress && !launched
}

/// Opens the `--metrics` file: appending to it (`--resume`: the resumed run's lines follow the
/// earlier ones) or replacing it. Whether an existing file may be replaced was decided before
/// (`paths::check_existing`).
///
/// # Errors
/// The path and the OS error.
pub fn open_metrics(path: &Path, append: bool) -> Result<File, String> {
    let mut o = std::fs::OpenOptions::new();
    o.create(true);
    if append {
        o.append(true);
    } else {
        o.write(true).truncate(true);
    }
    o.open(path)
        .map_err(|e| format!("--metrics {}: {e}", path.display()))
}

/// Rank 0's observer of the real program: progress bar on a terminal (else plain lines every
/// `every` steps, on the first and on the last) and the metrics file, each line written through
/// to the file as the step ends (an interrupted run leaves every completed step's line).
pub struct Console {
    bar: Option<ProgressBar>,
    every: usize,
    total: usize,
    metrics: Option<(PathBuf, LineWriter<File>)>,
    /// First error writing the metrics file (reported at the end; training goes on).
    metrics_error: Option<String>,
}

impl Console {
    /// `progress`: draw a bar (see [`wants_progress_bar`]).
    pub fn new(progress: bool, every: usize, metrics: Option<(PathBuf, File)>) -> Console {
        let bar = progress.then(|| {
            let b = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stdout());
            b.set_style(
                ProgressStyle::with_template(
                    "{bar:30.cyan/blue} step {pos}/{len} | {msg} | {elapsed_precise} ETA {eta}",
                )
                .expect("a fixed, valid template")
                .progress_chars("=> "),
            );
            b
        });
        Console {
            bar,
            every: every.max(1),
            total: 0,
            metrics: metrics.map(|(p, f)| (p, LineWriter::new(f))),
            metrics_error: None,
        }
    }

    fn println(&self, line: &str) {
        match &self.bar {
            Some(b) => b.println(line),
            None => println!("{line}"),
        }
    }
}

impl Observer for Console {
    fn start(&mut self, first: usize, total: usize) {
        self.total = total;
        if let Some(b) = &self.bar {
            b.set_length(total as u64);
            b.set_position(first.saturating_sub(1) as u64);
            b.reset_eta();
        }
    }

    fn step(&mut self, r: &StepRecord) {
        if let Some((p, w)) = &mut self.metrics {
            let obj = metrics_json(r);
            if let Err(e) = writeln!(w, "{obj}") {
                self.metrics_error
                    .get_or_insert(format!("writing {}: {e}", p.display()));
            }
        }
        let periodic = r.step == 1 || r.step % self.every == 0 || r.step == self.total;
        match &self.bar {
            Some(b) => {
                b.set_position(r.step as u64);
                b.set_message(format!(
                    "loss {:.3} | {} tok/s",
                    r.loss,
                    thousands(r.tokens_per_s.round() as u64)
                ));
                if periodic || r.val_loss.is_some() {
                    b.println(step_line(r));
                }
            }
            None => {
                if periodic || r.val_loss.is_some() {
                    println!("{}", step_line(r));
                }
            }
        }
    }

    fn note(&mut self, line: &str) {
        self.println(line);
    }

    fn finish(&mut self) -> Result<(), String> {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
        if let Some((p, w)) = &mut self.metrics {
            if let Err(e) = w.flush() {
                self.metrics_error
                    .get_or_insert(format!("writing {}: {e}", p.display()));
            }
        }
        match self.metrics_error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// One `--metrics` line.
pub fn metrics_json(r: &StepRecord) -> Value {
    let f = |x: f64| if x.is_finite() { json!(x) } else { Value::Null };
    let mut o = json!({
        "step": r.step,
        "loss": f(r.loss as f64),
        "tokens_per_s": f(r.tokens_per_s),
        // The f32's shortest decimal (0.05, not 0.05000000074505806).
        "lr": r.lr.to_string().parse::<f64>().unwrap_or(f64::NAN),
        "grad_norm": f(r.grad_norm),
        "step_s": r.secs,
        "peak_allocated_bytes": r.peak_allocated,
        "peak_reserved_bytes": r.peak_reserved,
        "all_gather_bytes": r.ag,
        "reduce_scatter_bytes": r.rs,
        "all_reduce_bytes": r.ar,
        "comm_bytes": r.ag + r.rs + r.ar,
    });
    if let Some(v) = r.val_loss {
        o["val_loss"] = f(v as f64);
    }
    o
}

/// Model FLOPs per trained token (see "Model FLOP/s" above): `6·Ψ` for a model of `params`
/// parameters plus `12·L·d·T` for the attention products.
pub fn flops_per_token(g: &dyn crate::model::Family, params: u64) -> f64 {
    6.0 * params as f64 + 12.0 * (g.n_layers() * g.d_model() * g.seq_len()) as f64
}

/// Which backend `--plot PATH` uses, from its extension.
pub fn plot_kind(path: &Path) -> Result<&'static str, String> {
    match path.extension().and_then(|e| e.to_str()) {
        Some("svg") => Ok("svg"),
        Some("png") => Ok("png"),
        _ => Err(format!(
            "--plot {}: the file must end in .svg or .png",
            path.display()
        )),
    }
}

/// Draws train/validation loss (top) and tokens/s (bottom) against step from the history
/// objects (`step`, `loss`, `val_loss`, `tokens_per_s`). PNG output has the curves and axes but
/// no text: the build has no font rasterizer (no system font or freetype dependency).
pub fn plot(path: &Path, history: &[Value]) -> Result<(), String> {
    let pts = |key: &str| -> Vec<(f64, f64)> {
        history
            .iter()
            .filter_map(|h| {
                let s = h.get("step")?.as_f64()?;
                let v = h.get(key)?.as_f64()?;
                v.is_finite().then_some((s, v))
            })
            .collect()
    };
    let (train, val, speed) = (pts("loss"), pts("val_loss"), pts("tokens_per_s"));
    let size = (900, 700);
    let res = match plot_kind(path)? {
        "svg" => draw(
            SVGBackend::new(path, size).into_drawing_area(),
            &train,
            &val,
            &speed,
            true,
        ),
        // No font rasterizer is built in: the PNG has curves, grid and legend colours, no text.
        _ => draw(
            BitMapBackend::new(path, size).into_drawing_area(),
            &train,
            &val,
            &speed,
            false,
        ),
    };
    res.map_err(|e| format!("drawing {}: {e}", path.display()))
}

type Pts = [(f64, f64)];

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    train: &Pts,
    val: &Pts,
    speed: &Pts,
    text: bool,
) -> Result<(), Box<dyn std::error::Error + 'static>>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(430);
    let max_step = train.iter().chain(val).map(|p| p.0).fold(1.0f64, f64::max);
    let (lo, hi) = train
        .iter()
        .chain(val)
        .fold((f64::MAX, f64::MIN), |(l, h), p| (l.min(p.1), h.max(p.1)));
    let (lo, hi) = if lo <= hi { (lo, hi) } else { (0.0, 1.0) };
    let pad = ((hi - lo) * 0.05).max(1e-3);
    let label = if text { 36 } else { 0 };

    let mut b = ChartBuilder::on(&top);
    b.margin(12)
        .x_label_area_size(label)
        .y_label_area_size(label * 3 / 2);
    if text {
        b.caption("loss", ("sans-serif", 22));
    }
    let mut c = b.build_cartesian_2d(0f64..max_step, (lo - pad).max(0.0)..hi + pad)?;
    if text {
        c.configure_mesh()
            .x_desc("step")
            .y_desc("cross-entropy")
            .draw()?;
    } else {
        c.configure_mesh()
            .disable_x_axis()
            .disable_y_axis()
            .draw()?;
    }
    c.draw_series(LineSeries::new(train.iter().copied(), BLUE.stroke_width(2)))?
        .label("train loss")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(2)));
    c.draw_series(LineSeries::new(val.iter().copied(), RED.stroke_width(2)))?
        .label("validation loss")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED.stroke_width(2)));
    c.draw_series(val.iter().map(|&p| Circle::new(p, 4, RED.filled())))?;
    if text {
        c.configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }

    let smax = speed.iter().map(|p| p.1).fold(1.0f64, f64::max);
    let mut b = ChartBuilder::on(&bottom);
    b.margin(12)
        .x_label_area_size(label)
        .y_label_area_size(label * 3 / 2);
    if text {
        b.caption("throughput", ("sans-serif", 22));
    }
    let mut s = b.build_cartesian_2d(0f64..max_step, 0f64..smax * 1.1)?;
    if text {
        s.configure_mesh()
            .x_desc("step")
            .y_desc("tokens/s")
            .draw()?;
    } else {
        s.configure_mesh()
            .disable_x_axis()
            .disable_y_axis()
            .draw()?;
    }
    s.draw_series(LineSeries::new(
        speed.iter().copied(),
        GREEN.stroke_width(2),
    ))?
    .label("tokens/s")
    .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], GREEN.stroke_width(2)));
    if text {
        s.configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

/// The first line of a run: model, data, ranks, strategy, optimizer, schedule, machine and
/// whatever is switched on. `data`: the data set's description; `params`: the model's own
/// parameter count (no padding); `threads`: matmul threads per rank.
pub fn banner(c: &TrainConfig, data: &str, cores: usize, threads: usize, params: u64) -> String {
    let g = &c.model;
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
    if g.tied() {
        extras.push_str(" | tied embedding/head");
    }
    if let Some(launch) = c.cuda {
        extras.push_str(&format!(" | {}", launch.describe(c.ranks)));
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
    if let Some(Quantization::Int8 { block }) = c.quantize_collectives {
        extras.push_str(&format!(" | int8 collectives (block {block})"));
    }
    format!(
        "train_gpt: {} ({} parameters) | data: {data} | \
         {} ranks × batch {} | {}{shard}, {} units, backward prefetch {}, forward prefetch {}, \
         limit all-gathers {} | {} lr {} | {} steps | seed {} | {cores} cores, {threads} matmul \
         thread(s)/rank{extras}",
        g.describe(),
        thousands(params),
        c.ranks,
        c.batch,
        strategy_name(c.strategy),
        g.unit_type(),
        prefetch_name(c.backward_prefetch),
        if c.forward_prefetch { "on" } else { "off" },
        limit_name(c),
        c.build_optimizer().name(),
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
        Some(Quantization::Int8 { .. }) => "int8",
    }
}

/// JSON has no NaN or infinity: those become `null`.
fn json_num(x: f64) -> Value {
    if x.is_finite() {
        json!(x)
    } else {
        Value::Null
    }
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

/// The sharding factor and the parameter(+gradient) peak the paper's formula predicts (see
/// the module docs).
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

/// The GEMM probe's result as the summary prints it (module `probe`).
pub struct GemmRate<'a> {
    /// FLOP/s.
    pub flops_per_s: f64,
    /// `"cpu"` or `"cuda:N"`.
    pub device: &'a str,
    /// The precision it ran at.
    pub dtype: DType,
    /// The reference BLAS's rate beside it (the `reference` line, `gemm_reference_*` fields).
    pub reference: &'a ReferenceProbe,
}

/// The summary of a finished run (rank 0): model, loss, speed, compute, memory, state and
/// communication lines, then with `json_line` the `--json` object on one line. `wall`: the
/// run's seconds; `params`: the model's own parameter count.
pub fn summary(
    c: &TrainConfig,
    rep: &Report,
    wall: f64,
    gemm: &GemmRate<'_>,
    params: u64,
    json_line: bool,
) {
    let gemm_rate = gemm.flops_per_s;
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
    let model_flops = flops_per_token(&*c.model, params) * tokens_per_s;
    println!(
        "  compute    {:.2} GFLOP/s model FLOPs (6·Ψ + attention per token) vs {:.2} GFLOP/s {} \
         GEMM probe on {} ({:.0}%)",
        model_flops / 1e9,
        gemm_rate / 1e9,
        gemm.dtype,
        if gemm.device == "cpu" {
            "all cores"
        } else {
            gemm.device
        },
        100.0 * model_flops / gemm_rate
    );
    if gemm.device == "cpu" {
        println!("{}", gemm.reference.summary_line(model_flops));
    }
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
        let mut j = json!({
            "ranks": c.ranks,
            "backend": c.backend().name(),
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
            "gemm_probe_device": gemm.device,
            "gemm_probe_dtype": gemm.dtype.to_string(),
            "limit_all_gathers": limit_name(c),
            "quantize_collectives": quant_name(c),
        });
        for (k, v) in gemm.reference.json_fields(model_flops) {
            j[k] = v;
        }
        println!("{j}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (#41): under `mpirun` a rank's stdout may be a pseudo-terminal while the job's
    /// output goes to a file; the bar's escape codes landed in the log.
    #[test]
    fn progress_bar_only_on_two_terminals_without_a_launcher() {
        assert!(wants_progress_bar(true, true, false, false));
        assert!(
            !wants_progress_bar(true, true, true, false),
            "--no-progress"
        );
        assert!(
            !wants_progress_bar(true, true, false, true),
            "mpi/nccl processes"
        );
        assert!(
            !wants_progress_bar(true, false, false, false),
            "stderr redirected"
        );
        assert!(
            !wants_progress_bar(false, true, false, false),
            "stdout redirected"
        );
    }

    fn history() -> Vec<Value> {
        (1..=30)
            .map(|s| {
                let val = (s % 10 == 0).then(|| json!(4.0 - s as f64 * 0.05));
                json!({"step": s, "loss": 5.0 - s as f64 * 0.1, "val_loss": val,
                       "tokens_per_s": 1000.0 + s as f64})
            })
            .collect()
    }

    #[test]
    fn svg_has_train_val_and_speed_curves() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("loss.svg");
        plot(&p, &history()).unwrap();
        let svg = std::fs::read_to_string(&p).unwrap();
        assert!(svg.starts_with("<svg"));
        assert!(svg.contains("train loss") && svg.contains("validation loss"));
        assert!(svg.contains("tokens/s"));
        // Three line series (train, validation, tokens/s) plus the three legend samples.
        assert!(svg.matches("<polyline").count() >= 3, "{}", svg.len());
    }

    #[test]
    fn the_banner_and_json_name_the_backend_of_gpu_ranks() {
        use crate::job::CudaLaunch;
        use clap::Parser;
        let mut c = crate::cli::Cli::try_parse_from(["train_gpt", "--ranks", "4"])
            .unwrap()
            .into_config()
            .unwrap();
        let cases = [
            (
                CudaLaunch::SharedGpu,
                false,
                "shared-gpu",
                " | backend: shared-gpu (4 thread ranks on cuda:0; collectives through GPU \
                 memory, link speeds not shown)",
            ),
            (CudaLaunch::Mpi, true, "mpi", "MPI with host staging"),
            (
                CudaLaunch::Threads,
                false,
                "nccl-threads",
                " | CUDA: a thread per GPU, NCCL",
            ),
            (
                CudaLaunch::Processes,
                false,
                "nccl",
                " | CUDA: a process per GPU, NCCL",
            ),
        ];
        for (launch, mpi, name, phrase) in cases {
            (c.cuda, c.mpi) = (Some(launch), mpi);
            let b = banner(&c, "synthetic", 2, 1, 1000);
            assert!(b.contains(phrase), "{launch:?}: {b}");
            assert_eq!(c.backend().name(), name, "{launch:?}");
        }
    }

    #[test]
    fn png_is_written_without_a_font_backend() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("loss.png");
        plot(&p, &history()).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        assert!(plot(&dir.path().join("x.pdf"), &history()).is_err());
    }
}
