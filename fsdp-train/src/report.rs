//! Output: the progress bar or plain step lines, the `--metrics` JSON-lines file, the `--plot`
//! picture and the GEMM-rate probe.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fsdp_alloc::{DType, Device};
use fsdp_autograd::Tensor;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use plotters::prelude::*;
use serde_json::{json, Value};

use crate::job::{Observer, StepRecord};

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

/// Rank 0's observer of the real program: progress bar on a terminal (else plain lines every
/// `every` steps, on the first and on the last) and the metrics file.
pub struct Console {
    bar: Option<ProgressBar>,
    every: usize,
    total: usize,
    metrics: Option<(PathBuf, BufWriter<File>)>,
    /// First error writing the metrics file (reported at the end; training goes on).
    metrics_error: Option<String>,
}

impl Console {
    /// `progress`: draw a bar (stdout is a terminal and it was not turned off).
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
            metrics: metrics.map(|(p, f)| (p, BufWriter::new(f))),
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

/// The f32 GEMM rate this machine reaches with the project's matmul kernel (the `gemm` crate)
/// on `threads` threads: square 384×384×384 products repeated for about `budget`. Returns
/// FLOP/s (2·n³ per product).
pub fn gemm_probe(threads: usize, budget: Duration) -> Result<f64, String> {
    let n = 384usize;
    let dev = Device::cpu(20_000);
    let a = Tensor::full(&[n, n], 0.5, DType::F32, &dev).map_err(|e| e.to_string())?;
    let b = Tensor::full(&[n, n], 0.25, DType::F32, &dev).map_err(|e| e.to_string())?;
    fsdp_autograd::kernels::cpu::set_matmul_threads(threads);
    // Warm-up (packing buffers, thread pool).
    a.matmul(&b)
        .and_then(|c| c.item_at0())
        .map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let mut reps = 0u64;
    while t0.elapsed() < budget || reps < 2 {
        a.matmul(&b)
            .and_then(|c| c.item_at0())
            .map_err(|e| e.to_string())?;
        reps += 1;
    }
    let secs = t0.elapsed().as_secs_f64();
    Ok(2.0 * (n * n * n) as f64 * reps as f64 / secs)
}

/// Waiting for a result (the CPU stream runs the kernel asynchronously).
trait ItemAt0 {
    fn item_at0(&self) -> fsdp_autograd::Result<f32>;
}

impl ItemAt0 for Tensor {
    fn item_at0(&self) -> fsdp_autograd::Result<f32> {
        self.reshape(&[self.numel()])?.narrow(0, 0, 1)?.item()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn png_is_written_without_a_font_backend() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("loss.png");
        plot(&p, &history()).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        assert!(plot(&dir.path().join("x.pdf"), &history()).is_err());
    }
}
