//! Int8 quantized collectives against f32 over a 300-step GPT-mini run (issue #18's last
//! criterion): `cargo xtask bench quantized` (= `cargo bench -p fsdp-core --bench quantized`).
//!
//! Two runs with the same protocol, one with f32 collectives and one with
//! `quantize_collectives = Int8 { block }`; nothing else differs (same seed, same batches, same
//! initial weights). The protocol, fixed before any result was seen:
//!
//! - GPT-mini (vocab 256, d 256, 4 layers, 4 heads, seq 128), 4 CPU thread ranks, FullShard,
//!   one unit per `Block` plus the root, BackwardPre, rate limiter on, 4 sequences per rank;
//! - AdamW (betas 0.9/0.999, eps 1e-8, weight decay 0.01), peak lr 1e-3, linear warm-up over 30
//!   steps, cosine decay to 1e-4 at step 300 (the schedule ends at the step that is compared,
//!   so the loss there is not measured mid-fall);
//! - real text: the workspace's own `*.rs` and `*.md` files (every checkout has them; `target/`
//!   and dot-directories skipped), concatenated in byte order of their relative paths into
//!   `target/quantized/corpus.txt`, read as bytes (vocab 256) by `train_gpt`'s data module
//!   (`fsdp-train/src/data.rs`: training sequences at SplitMix64 offsets of the first 90%,
//!   a fixed validation set of 32 sequences evenly spaced over the last 10%). The corpus grows
//!   with the code; its size and FNV-1a hash are printed and put in the JSON;
//! - the compared loss is the **validation loss at step 300** (held-out, the same 32 sequences
//!   for both runs; also evaluated at steps 100 and 200); the last training step's loss and the
//!   mean of the last 20 training losses are reported beside it.
//!
//! Bytes: `all_gather_bytes` / `reduce_scatter_bytes` are rank 0's `Fsdp::comm_stats` after the
//! run (training steps and the evaluations' forwards alike, identical in both runs).
//!
//! Written under `target/quantized/`: `quantized.svg` (both training-loss curves and the
//! validation points; plotters' SVG backend) and `corpus.txt`. The last stdout line is one JSON
//! object: `all_gather_bytes_over_f32`, `reduce_scatter_bytes_over_f32`, `f32_loss_300`,
//! `int8_loss_300`, `loss_rel_diff_300` (`|int8 − f32| / f32` of the validation loss at step
//! 300), `within_2_percent`, the train-loss figures, the protocol and the wall time.
//!
//! Environment: `QUANTIZED_SEED` (default 0) changes the seed of the model init and of the data
//! order (for the run-to-run spread); `QUANTIZED_BLOCK` (default 64) the values per scale;
//! `QUANTIZED_DATA=synthetic` trains on `train_gpt`'s synthetic counting stream instead of the
//! corpus.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use fsdp_alloc::Device;
use fsdp_autograd::nn::{Gpt, GptConfig};
use fsdp_autograd::{cross_entropy, no_grad, InitContext, Tensor};
use fsdp_collectives::{ProcessGroup, ThreadGroup};
use fsdp_core::{
    AdamW, BackwardPrefetch, Comm, CommStats, Fsdp, FsdpConfig, Quantization, ShardedOptimizer,
    ShardingStrategy, WrapPolicy,
};

#[allow(dead_code, unused_imports)]
#[path = "../src/data.rs"]
mod data;
use data::{DataFormat, Dataset};

const WORLD: usize = 4;
const BATCH: usize = 4;
const STEPS: usize = 300;
const LR: f32 = 1e-3;
const WARMUP: usize = 30;
const MIN_LR: f32 = 1e-4;
const EVAL_EVERY: usize = 100;
const EVAL_SEQS: usize = 32;
const VAL_FRACTION: f64 = 0.1;
/// Training losses averaged at the end of the run.
const LAST_K: usize = 20;

/// Learning rate of step `s` (0-based): `train_gpt`'s `--warmup-steps` / `--min-lr` schedule.
fn lr_at(s: usize) -> f32 {
    if s < WARMUP {
        return LR * (s + 1) as f32 / WARMUP as f32;
    }
    let span = (STEPS - WARMUP).saturating_sub(1).max(1) as f64;
    let progress = ((s - WARMUP) as f64 / span).min(1.0);
    let c = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
    (MIN_LR as f64 + (LR - MIN_LR) as f64 * c) as f32
}

/// What one rank reports.
struct RankOut {
    /// This rank's loss of every step, already scaled by 1/W (the sum over ranks is the
    /// global-batch mean).
    scaled_losses: Vec<f32>,
    /// (step, summed token loss, tokens) of every evaluation on this rank's sequences.
    evals: Vec<(usize, f64, f64)>,
    stats: CommStats,
}

/// One run, reduced over ranks.
struct Outcome {
    losses: Vec<f64>,
    /// (step, validation loss).
    val: Vec<(usize, f64)>,
    stats: CommStats,
    secs: f64,
}

impl Outcome {
    fn val_at(&self, step: usize) -> f64 {
        self.val
            .iter()
            .find(|v| v.0 == step)
            .map_or(f64::NAN, |v| v.1)
    }

    fn last_k_mean(&self) -> f64 {
        let tail = &self.losses[self.losses.len() - LAST_K..];
        tail.iter().sum::<f64>() / tail.len() as f64
    }
}

fn err<E: std::fmt::Display>(what: &str) -> impl Fn(E) -> String + '_ {
    move |e| format!("{what}: {e}")
}

fn evaluate(
    fsdp: &Fsdp<Gpt>,
    data: &Dataset,
    dev: &Device,
    rank: usize,
    seed: u64,
) -> Result<(f64, f64), String> {
    let seq = GptConfig::mini().seq_len;
    let vocab = GptConfig::mini().vocab;
    let rounds = EVAL_SEQS.div_ceil(WORLD * BATCH);
    let (mut sum, mut count) = (0f64, 0f64);
    for round in 0..rounds {
        let first = round * WORLD * BATCH + rank * BATCH;
        let mine: Vec<usize> = (first..first + BATCH).filter(|&i| i < EVAL_SEQS).collect();
        // Every rank runs the same number of forwards (their all-gathers pair up).
        let (idx, weight) = if mine.is_empty() {
            (vec![0], 0.0)
        } else {
            (mine, 1.0)
        };
        let (mut ids, mut tg) = (Vec::new(), Vec::new());
        for &i in &idx {
            let (a, t) = data
                .val_sequence(i as u64, EVAL_SEQS as u64, seq, seed)
                .map_err(err("validation data"))?;
            ids.extend(a);
            tg.extend(t);
        }
        let k = idx.len();
        let ce = no_grad(|| -> Result<f32, fsdp_core::FsdpError> {
            let x = Tensor::from_vec(ids, &[k, seq], dev)?;
            let y = Tensor::from_vec(tg, &[k * seq], dev)?;
            let logits = fsdp.forward(&x)?;
            let flat = logits.reshape(&[k * seq, vocab])?;
            Ok(cross_entropy(&flat, &y)?.item()?)
        })
        .map_err(err("evaluating"))?;
        sum += weight * ce as f64 * (k * seq) as f64;
        count += weight * (k * seq) as f64;
    }
    Ok((sum, count))
}

fn run_rank(
    rank: usize,
    pg: Arc<dyn ProcessGroup>,
    quant: Option<Quantization>,
    data: &Dataset,
    seed: u64,
) -> Result<RankOut, String> {
    let cfg = GptConfig::mini();
    let dev = Device::cpu(rank);
    let model = Gpt::new(&InitContext::eager(&dev, seed), &cfg).map_err(err("model"))?;
    let config = FsdpConfig {
        strategy: ShardingStrategy::FullShard,
        wrap_policy: WrapPolicy::ModuleTypes(vec!["Block".into()]),
        backward_prefetch: BackwardPrefetch::BackwardPre,
        limit_all_gathers: true,
        quantize_collectives: quant,
        ..FsdpConfig::default()
    };
    let fsdp = Fsdp::wrap(model, &dev, Comm::from(Arc::clone(&pg)), config).map_err(err("wrap"))?;
    let mut opt = AdamW::new(LR);
    let mut out = RankOut {
        scaled_losses: Vec::with_capacity(STEPS),
        evals: Vec::new(),
        stats: CommStats::default(),
    };
    let shape = [BATCH, cfg.seq_len];
    for s in 0..STEPS {
        let first = (s * WORLD * BATCH + rank * BATCH) as u64;
        let (mut ids, mut tg) = (Vec::new(), Vec::new());
        for b in 0..BATCH as u64 {
            let (i, t) = data
                .train_sequence(first + b, cfg.seq_len, seed)
                .map_err(err("training data"))?;
            ids.extend(i);
            tg.extend(t);
        }
        let x = Tensor::from_vec(ids, &shape, &dev).map_err(err("batch"))?;
        let y = Tensor::from_vec(tg, &[BATCH * cfg.seq_len], &dev).map_err(err("batch"))?;
        let mut step = || -> Result<f32, fsdp_core::FsdpError> {
            let logits = fsdp.forward(&x)?;
            let flat = logits.reshape(&[logits.numel() / cfg.vocab, cfg.vocab])?;
            let loss = cross_entropy(&flat, &y)?.scale(1.0 / WORLD as f32)?;
            loss.backward()?;
            let l = loss.item()?;
            opt.hyper.lr = lr_at(s);
            opt.step(&fsdp)?;
            fsdp.synchronize()?;
            opt.zero_grad(&fsdp);
            Ok(l)
        };
        out.scaled_losses
            .push(step().map_err(err("training step"))?);
        let done = s + 1;
        if done % EVAL_EVERY == 0 || done == STEPS {
            let (sum, count) = evaluate(&fsdp, data, &dev, rank, seed)?;
            out.evals.push((done, sum, count));
        }
    }
    out.stats = fsdp.comm_stats();
    Ok(out)
}

fn run(quant: Option<Quantization>, data: &Dataset, seed: u64) -> Result<Outcome, String> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    fsdp_autograd::kernels::cpu::set_matmul_threads((cores / WORLD).max(1));
    let t0 = Instant::now();
    let handles: Vec<_> = ThreadGroup::new(WORLD)
        .into_iter()
        .enumerate()
        .map(|(r, g)| {
            let d = data.clone();
            std::thread::Builder::new()
                .name(format!("rank{r}"))
                .spawn(move || run_rank(r, Arc::new(g), quant, &d, seed))
                .expect("spawning a rank thread")
        })
        .collect();
    let mut outs = Vec::new();
    for h in handles {
        outs.push(h.join().map_err(|_| "a rank panicked".to_string())??);
    }
    let secs = t0.elapsed().as_secs_f64();
    let losses = (0..STEPS)
        .map(|s| outs.iter().map(|o| o.scaled_losses[s] as f64).sum())
        .collect();
    let val = (0..outs[0].evals.len())
        .map(|i| {
            let (sum, count) = outs
                .iter()
                .fold((0.0, 0.0), |a, o| (a.0 + o.evals[i].1, a.1 + o.evals[i].2));
            (outs[0].evals[i].0, sum / count)
        })
        .collect();
    Ok(Outcome {
        losses,
        val,
        stats: outs[0].stats,
        secs,
    })
}

fn out_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../target")));
    target.join("quantized")
}

/// Every `*.rs` and `*.md` file under `dir` (skipping `skip` and dot-entries), as
/// (path relative to the workspace, absolute path).
fn collect(
    dir: &Path,
    root: &Path,
    skip: &Path,
    out: &mut Vec<(String, PathBuf)>,
) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if name.starts_with('.') || path == skip {
            continue;
        }
        if path.is_dir() {
            collect(&path, root, skip, out)?;
        } else if name.ends_with(".rs") || name.ends_with(".md") {
            let rel = path
                .strip_prefix(root)
                .unwrap_or(&path)
                .to_string_lossy()
                .into_owned();
            out.push((rel, path));
        }
    }
    Ok(())
}

/// Writes the corpus (see the module docs) to `path`; returns (bytes, files, FNV-1a hash).
fn build_corpus(path: &Path) -> Result<(usize, usize, u64), String> {
    let root = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let root = root.canonicalize().map_err(err("workspace root"))?;
    let mut files = Vec::new();
    collect(&root, &root, &root.join("target"), &mut files).map_err(err("listing sources"))?;
    files.sort();
    let mut text = Vec::new();
    for (_, p) in &files {
        text.extend(std::fs::read(p).map_err(err("reading a source file"))?);
    }
    std::fs::write(path, &text).map_err(err("writing the corpus"))?;
    let hash = text.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    });
    Ok((text.len(), files.len(), hash))
}

fn plot(path: &Path, runs: &[(&str, &Outcome)]) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (900, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let ymax = runs
        .iter()
        .flat_map(|r| r.1.losses.iter().copied())
        .fold(0.0, f64::max)
        .min(6.0)
        * 1.05;
    let mut ch = ChartBuilder::on(&root)
        .caption(
            "GPT-mini, 4 ranks: loss with f32 vs int8 collectives",
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..STEPS as f64, 0f64..ymax)?;
    ch.configure_mesh().x_desc("step").y_desc("loss").draw()?;
    for (i, (name, o)) in runs.iter().enumerate() {
        let color = if i == 0 { BLUE } else { RED };
        let pts: Vec<(f64, f64)> = o
            .losses
            .iter()
            .enumerate()
            .map(|(s, &l)| ((s + 1) as f64, l))
            .collect();
        ch.draw_series(LineSeries::new(pts, color.mix(0.7)))?
            .label(format!("{name} train"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
        ch.draw_series(
            o.val
                .iter()
                .map(move |&(s, v)| Circle::new((s as f64, v), 5, color.filled())),
        )?
        .label(format!("{name} validation"))
        .legend(move |(x, y)| Circle::new((x + 8, y), 4, color.filled()));
    }
    ch.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

fn main() -> Result<(), String> {
    let start = Instant::now();
    let dir = out_dir();
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let env_num = |name: &str, default: u64| -> Result<u64, String> {
        match std::env::var(name) {
            Ok(v) => v.parse().map_err(|_| format!("{name}={v} is not a number")),
            Err(_) => Ok(default),
        }
    };
    let seed = env_num("QUANTIZED_SEED", 0)?;
    let block = env_num("QUANTIZED_BLOCK", Quantization::DEFAULT_BLOCK as u64)? as usize;
    let synthetic = std::env::var("QUANTIZED_DATA").is_ok_and(|v| v == "synthetic");
    let cfg = GptConfig::mini();
    let (data, data_desc, corpus) = if synthetic {
        let d = Dataset::Synthetic { vocab: cfg.vocab };
        (d, "synthetic counting stream".to_string(), None)
    } else {
        let path = dir.join("corpus.txt");
        let (bytes, files, hash) = build_corpus(&path)?;
        let d = Dataset::open(
            &path,
            DataFormat::Text,
            VAL_FRACTION,
            cfg.seq_len,
            cfg.vocab,
        )
        .map_err(|e| e.to_string())?;
        (
            d,
            format!(
                "workspace *.rs + *.md as bytes ({files} files, {bytes} bytes, fnv1a {hash:016x})"
            ),
            Some((bytes, files, hash)),
        )
    };
    println!(
        "quantized bench: GPT-mini, {WORLD} thread ranks × {BATCH} sequences, FullShard, \
         {STEPS} AdamW steps (lr {LR}, warm-up {WARMUP}, cosine to {MIN_LR}), seed {seed}"
    );
    println!(
        "data: {data_desc}; validation: {EVAL_SEQS} held-out sequences every {EVAL_EVERY} steps"
    );

    let f32_run = run(None, &data, seed)?;
    println!("f32 run: {:.1} s", f32_run.secs);
    let int8_run = run(Some(Quantization::Int8 { block }), &data, seed)?;
    println!("int8 (block {block}) run: {:.1} s", int8_run.secs);

    let rel = |a: f64, b: f64| (b - a).abs() / a;
    let (f, q) = (&f32_run, &int8_run);
    let ag = q.stats.all_gather_bytes as f64 / f.stats.all_gather_bytes as f64;
    let rs = q.stats.reduce_scatter_bytes as f64 / f.stats.reduce_scatter_bytes as f64;
    println!(
        "\n{:<32} | {:>14} | {:>14} | {:>8}",
        "", "f32", "int8", "ratio/diff"
    );
    println!(
        "{:<32} | {:>14} | {:>14} | {:>8.3}×",
        "all-gather bytes (rank 0)", f.stats.all_gather_bytes, q.stats.all_gather_bytes, ag
    );
    println!(
        "{:<32} | {:>14} | {:>14} | {:>8.3}×",
        "reduce-scatter bytes (rank 0)",
        f.stats.reduce_scatter_bytes,
        q.stats.reduce_scatter_bytes,
        rs
    );
    for &(s, v) in &f.val {
        let w = q.val_at(s);
        println!(
            "{:<32} | {:>14.4} | {:>14.4} | {:>7.2}%",
            format!("validation loss, step {s}"),
            v,
            w,
            100.0 * rel(v, w)
        );
    }
    let (fl, ql) = (f.losses[STEPS - 1], q.losses[STEPS - 1]);
    println!(
        "{:<32} | {:>14.4} | {:>14.4} | {:>7.2}%",
        format!("train loss, step {STEPS}"),
        fl,
        ql,
        100.0 * rel(fl, ql)
    );
    let (fk, qk) = (f.last_k_mean(), q.last_k_mean());
    println!(
        "{:<32} | {:>14.4} | {:>14.4} | {:>7.2}%",
        format!("mean train loss, last {LAST_K} steps"),
        fk,
        qk,
        100.0 * rel(fk, qk)
    );
    println!("train loss every 25 steps (f32 / int8):");
    for s in (25..=STEPS).step_by(25) {
        println!(
            "  step {s:>3}: {:.4} / {:.4}",
            f.losses[s - 1],
            q.losses[s - 1]
        );
    }
    let (f300, q300) = (f.val_at(STEPS), q.val_at(STEPS));
    let diff = rel(f300, q300);
    let within = diff <= 0.02;
    println!(
        "validation loss at step {STEPS}: f32 {f300:.4}, int8 {q300:.4}, |int8 − f32| / f32 = \
         {:.2}% ({} 2%)",
        100.0 * diff,
        if within { "within" } else { "NOT within" }
    );
    let svg = dir.join("quantized.svg");
    plot(&svg, &[("f32", f), ("int8", q)])
        .map_err(|e| format!("writing {}: {e}", svg.display()))?;
    println!("plot written to {}", svg.display());
    let wall = start.elapsed().as_secs_f64();
    println!("wall time {wall:.0} s");

    let data_json = match corpus {
        Some((bytes, files, hash)) => format!(
            "{{\"kind\":\"workspace_rs_md_text\",\"bytes\":{bytes},\"files\":{files},\
             \"fnv1a\":\"{hash:016x}\",\"val_fraction\":{VAL_FRACTION}}}"
        ),
        None => "{\"kind\":\"synthetic\"}".to_string(),
    };
    println!(
        "{{\"all_gather_bytes_over_f32\":{ag:.4},\"reduce_scatter_bytes_over_f32\":{rs:.4},\
         \"f32_loss_300\":{f300:.5},\"int8_loss_300\":{q300:.5},\"loss_rel_diff_300\":{diff:.5},\
         \"within_2_percent\":{within},\"loss_measure\":\"validation loss at step {STEPS} \
         ({EVAL_SEQS} held-out sequences)\",\"f32_train_loss_300\":{fl:.5},\
         \"int8_train_loss_300\":{ql:.5},\"train_loss_rel_diff_300\":{:.5},\
         \"f32_train_loss_last{LAST_K}_mean\":{fk:.5},\"int8_train_loss_last{LAST_K}_mean\":{qk:.5},\
         \"train_loss_last{LAST_K}_rel_diff\":{:.5},\"f32_all_gather_bytes\":{},\
         \"int8_all_gather_bytes\":{},\"protocol\":{{\"model\":\"gpt-mini\",\"ranks\":{WORLD},\
         \"batch_per_rank\":{BATCH},\"steps\":{STEPS},\"optimizer\":\"adamw\",\"lr\":{LR},\
         \"schedule\":\"linear warm-up {WARMUP} steps, cosine to {MIN_LR} at step {STEPS}\",\
         \"data\":{data_json},\"seed\":{seed},\"block\":{block},\"eval_every\":{EVAL_EVERY},\
         \"eval_seqs\":{EVAL_SEQS}}},\"f32_secs\":{:.1},\"int8_secs\":{:.1},\"wall_secs\":{wall:.1}}}",
        rel(fl, ql),
        rel(fk, qk),
        f.stats.all_gather_bytes,
        q.stats.all_gather_bytes,
        f.secs,
        q.secs
    );
    Ok(())
}
