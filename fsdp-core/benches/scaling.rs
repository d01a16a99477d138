//! How FSDP's cost grows with rank count and model size: `cargo xtask bench scaling`
//! (= `cargo bench -p fsdp-core --bench scaling`).
//!
//! Every run trains a GPT with FullShard, one unit per `Block` plus the root, BackwardPre, the
//! rate limiter on, AdamW, f32, on `W` CPU thread ranks; each rank's matmuls get
//! `max(1, cores / W)` threads (as in `train_gpt`). A step is forward + loss + backward + AdamW
//! + a full synchronization of the rank's streams, timed on rank 0 from a barrier.
//!
//! (a) **Memory vs W** — GPT-mini at W = 1, 2, 4, 8 (4 sequences per rank, 2 steps): per rank,
//!     the *sharded state* (the bytes of the parameter shards, their reduced gradients and
//!     AdamW's two moment tensors, counted from the live tensors after the optimizer step, the
//!     moment they all exist) and the peak allocated bytes of the whole step (the device
//!     allocator's `peak_allocated_bytes`; includes gathered units, activations, gradients).
//!     `sharded_state_bytes_w8_over_w1` = state(W=8) / state(W=1): FSDP's promise is 1/8, plus
//!     the padding of each unit to a multiple of W.
//! (b) **Time vs model size** at W = 4: GPT-mini (vocab 256, d 256, 4 layers, seq 128, 4
//!     sequences per rank), a ~25M model (vocab 256, d 512, 8 layers, 8 heads, seq 128, 2
//!     sequences per rank) and the 124M GPT-2 shape (vocab 50257, d 768, 12 layers, 12 heads) at a
//!     short sequence (64, 1 sequence per rank) — with an untied LM head, so 162M parameters
//!     (GPT-2 ties it to the embedding: 124M) — median step time over the counted steps (few
//!     for the big models) and tokens/s.
//! (c) **Model FLOP rate over the GEMM peak**: model FLOPs per step = tokens · (6Ψ + 12·L·T·d)
//!     (Ψ = all parameters, embeddings included; the second term is attention's QKᵀ and AV,
//!     forward and backward, counted over the full T×T square like PaLM's formula, although the
//!     CPU kernel is block-causal and does 5/8 of that square at T = 128) divided by
//!     the step time, over two denominators, each the best rate measured in this run of one
//!     all-cores call and of one concurrent 1-thread call per core on f32 1024×1024×1024 (three
//!     repetitions each, measured before the runs and again right after GPT-mini's — on a
//!     shared machine the best of both is the fairer denominator):
//!     - `gemm_peak_gflops`: our own matmul (`gemm`'s kernels at the process's CPU level,
//!       `FSDP_CPU_ISA`); `model_flops_over_gemm` is GPT-mini's rate over it — a limit we set
//!       ourselves;
//!     - `gemm_reference_flops_per_s`: the machine's limit through an independent, well-tuned
//!       BLAS (OpenBLAS's `cblas_sgemm`, loaded at run time, its kernels matched to the CPU
//!       level; see `fsdp_autograd::kernels::cpu::ReferenceGemm`): the higher of its best
//!       measured multi-core rate and every core at its one-core rate (best 1-thread 1024³ call
//!       on thread CPU time, `gemm_reference_one_core_gflops`) — OpenBLAS's own threads scaled
//!       badly on the 2-core development VM, and a shared machine would lower the measured
//!       rates, which must not flatter the ratio. `model_flops_over_reference_gemm` is GPT-mini's
//!       rate over it. Both `null` (with `gemm_reference_note` saying why) where the library is
//!       not installed.
//! (d) **Per-shape GEMM rates**: every product of a training step of each model above (the
//!     five linear layers' forward, input-gradient and weight-gradient products at the model's
//!     tokens per rank; `scaling/gemm.rs`), ours vs the reference on the rank's thread count
//!     (`max(1, cores / W)`), interleaved, best of three rounds; a table, the `shapes` rows and
//!     per model the FLOP-weighted ratio (total FLOPs over total time, ours over reference).
//!
//! Also written (under `target/scaling/`): `scaling.svg` (memory vs W, tokens/s vs model size;
//! plotters' SVG backend) and `gpt_mini_w4_trace.json`, a Chrome trace of one GPT-mini W=4 step
//! (`fsdp_alloc::trace`; open it in <https://ui.perfetto.dev>), whose per-category totals are
//! printed — where the step's time goes.
//!
//! The last stdout line is one JSON object: `model_flops_over_gemm`, `gemm_peak_gflops`,
//! `model_flops_over_reference_gemm`, `gemm_reference_flops_per_s`, `gemm_reference` (the
//! library and its kernels), `cpu_isa` (the level our kernels ran at),
//! `sharded_state_bytes_w8_over_w1`, `memory` rows, `models` rows and `shapes` rows.
//!
//! Environment: `SCALING_SKIP_124M=1` skips the 124M model (it takes most of the run time and
//! ~3 GB of memory); `SCALING_SHAPES_ONLY=1` measures only the two GEMM peaks and the per-shape
//! table (the JSON line then has no memory or model fields); `FSDP_CPU_ISA=avx2` (or
//! `baseline`) caps our kernels' and the reference's instruction-set level.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use fsdp_alloc::{trace, Device};
use fsdp_autograd::kernels::cpu::{cpu_isa, detected_cpu_isa, ReferenceGemm};
use fsdp_autograd::nn::{Gpt, GptConfig};
use fsdp_autograd::{cross_entropy, InitContext, Tensor};
use fsdp_collectives::{ProcessGroup, ThreadGroup};
use fsdp_core::{
    AdamW, BackwardPrefetch, Comm, Fsdp, FsdpConfig, ShardedOptimizer, ShardingStrategy, WrapPolicy,
};

mod common;
use common::median;
#[path = "scaling/gemm.rs"]
mod gemm_rates;
use gemm_rates::{Impl, Peak, ShapeRate};

const SEED: u64 = 0;
const LR: f32 = 1e-3;

/// One training configuration.
#[derive(Clone)]
struct Spec {
    name: &'static str,
    cfg: GptConfig,
    world: usize,
    batch: usize,
    warmup: usize,
    steps: usize,
    /// Record a trace of the first counted step to this path.
    trace: Option<PathBuf>,
}

/// What rank 0 reports (memory figures are the maximum over ranks).
#[derive(Debug, Clone, Default)]
struct Outcome {
    params: usize,
    step_secs: Vec<f64>,
    sharded_state_bytes: u64,
    peak_allocated_bytes: u64,
}

fn bytes_of(t: &Tensor) -> u64 {
    (t.numel() * t.dtype().size()) as u64
}

fn batch(index: usize, b: usize, cfg: &GptConfig) -> (Vec<i64>, Vec<i64>) {
    let (mut ids, mut tg) = (Vec::new(), Vec::new());
    for s in 0..b {
        let k = index * b + s;
        let start = (k * 7 + 3) % cfg.vocab;
        let stride = 1 + k % 3;
        for t in 0..cfg.seq_len {
            ids.push(((start + stride * t) % cfg.vocab) as i64);
            tg.push(((start + stride * (t + 1)) % cfg.vocab) as i64);
        }
    }
    (ids, tg)
}

fn run_rank(rank: usize, pg: Arc<dyn ProcessGroup>, spec: &Spec) -> Result<Outcome, String> {
    let e = |e: fsdp_core::FsdpError| format!("{}: rank {rank}: {e}", spec.name);
    let dev = Device::cpu(rank);
    let model = Gpt::new(&InitContext::eager(&dev, SEED), &spec.cfg).map_err(|x| x.to_string())?;
    let config = FsdpConfig {
        strategy: ShardingStrategy::FullShard,
        wrap_policy: WrapPolicy::ModuleTypes(vec!["Block".into()]),
        backward_prefetch: BackwardPrefetch::BackwardPre,
        limit_all_gathers: true,
        ..FsdpConfig::default()
    };
    let world = pg.size();
    let fsdp = Fsdp::wrap(model, &dev, Comm::from(Arc::clone(&pg)), config).map_err(e)?;
    let params: usize = fsdp.units().iter().map(|u| u.total_numel).sum();
    let mut opt = AdamW::new(LR);
    let mut out = Outcome {
        params,
        ..Outcome::default()
    };
    for step in 0..spec.warmup + spec.steps {
        let counted = step >= spec.warmup;
        let tracing = counted && step == spec.warmup && spec.trace.is_some();
        pg.barrier().map_err(|x| x.to_string())?;
        if tracing && rank == 0 {
            trace::start();
        }
        pg.barrier().map_err(|x| x.to_string())?;
        dev.reset_peak_stats();
        let t0 = Instant::now();
        let (ids, tg) = batch(step * world + rank, spec.batch, &spec.cfg);
        let shape = [spec.batch, spec.cfg.seq_len];
        let x = Tensor::from_vec(ids, &shape, &dev).map_err(|x| x.to_string())?;
        let y = Tensor::from_vec(tg, &shape, &dev).map_err(|x| x.to_string())?;
        let logits = fsdp.forward(&x).map_err(e)?;
        let v = spec.cfg.vocab;
        let flat = logits
            .reshape(&[logits.numel() / v, v])
            .map_err(|x| x.to_string())?;
        let loss = cross_entropy(&flat, &y.reshape(&[y.numel()]).map_err(|x| x.to_string())?)
            .map_err(|x| x.to_string())?
            .scale(1.0 / world as f32)
            .map_err(|x| x.to_string())?;
        loss.backward().map_err(|x| x.to_string())?;
        opt.step(&fsdp).map_err(e)?;
        fsdp.synchronize().map_err(e)?;
        let secs = t0.elapsed().as_secs_f64();
        // The sharded state, all live at this point: shards, reduced shard gradients, moments.
        let mut state = 0u64;
        for u in fsdp.shards() {
            state += bytes_of(&u.shard);
            state += u.grad.as_ref().map_or(0, bytes_of);
        }
        for (_, slot) in opt.state() {
            state += slot.iter().flatten().map(bytes_of).sum::<u64>();
        }
        opt.zero_grad(&fsdp);
        let peak = dev.memory_stats().peak_allocated_bytes as u64;
        pg.barrier().map_err(|x| x.to_string())?;
        if tracing && rank == 0 {
            let t = trace::stop();
            if let Some(path) = &spec.trace {
                print_profile(&t, secs);
                t.write_chrome_json(path)
                    .map_err(|x| format!("writing {}: {x}", path.display()))?;
                println!("  trace written to {}", path.display());
            }
        }
        if counted {
            out.step_secs.push(secs);
            out.sharded_state_bytes = out.sharded_state_bytes.max(state);
            out.peak_allocated_bytes = out.peak_allocated_bytes.max(peak);
        }
    }
    Ok(out)
}

/// Where the traced step's time went: busy time per stream kind (summed over ranks, as a
/// fraction of ranks × step time), blocked waits, and the largest ops.
fn print_profile(t: &trace::Trace, step_secs: f64) {
    let totals = t.totals();
    let ranks = t.events().iter().map(|e| e.pid).max().map_or(1, |p| p + 1);
    let wall_us = step_secs * 1e6 * ranks as f64;
    let mut by_track: std::collections::BTreeMap<(String, &str), f64> = Default::default();
    for x in &totals {
        if x.cat != "host" {
            *by_track.entry((x.track.clone(), x.cat)).or_default() += x.total_us;
        }
    }
    println!(
        "profile of one GPT-mini W={ranks} step ({:.1} ms; share = summed time / (ranks × step)):",
        step_secs * 1e3
    );
    for ((track, cat), us) in &by_track {
        println!(
            "  {:<10} {:<5} {:>9.1} ms  {:>5.1}%",
            track,
            cat,
            us / 1e3,
            100.0 * us / wall_us
        );
    }
    println!("  top stream work (all ranks):");
    for x in totals.iter().filter(|x| x.cat == "work").take(14) {
        println!(
            "    {:<28} {:<8} ×{:<5} {:>8.1} ms  {:>5.1}%",
            x.name,
            x.track,
            x.count,
            x.total_us / 1e3,
            100.0 * x.total_us / wall_us
        );
    }
}

fn run(spec: &Spec) -> Result<Outcome, String> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    fsdp_autograd::kernels::gemm::set_matmul_threads((cores / spec.world).max(1));
    let handles: Vec<_> = ThreadGroup::new(spec.world)
        .into_iter()
        .enumerate()
        .map(|(r, g)| {
            let s = spec.clone();
            std::thread::Builder::new()
                .name(format!("rank{r}"))
                .spawn(move || run_rank(r, Arc::new(g), &s))
                .expect("spawning a rank thread")
        })
        .collect();
    let mut outs = Vec::new();
    for h in handles {
        outs.push(h.join().map_err(|_| "a rank panicked".to_string())??);
    }
    let mut o = outs[0].clone();
    for x in &outs[1..] {
        o.sharded_state_bytes = o.sharded_state_bytes.max(x.sharded_state_bytes);
        o.peak_allocated_bytes = o.peak_allocated_bytes.max(x.peak_allocated_bytes);
    }
    Ok(o)
}

fn model_flops(cfg: &GptConfig, params: usize, tokens: usize) -> f64 {
    let attn = 12.0 * (cfg.n_layers * cfg.seq_len * cfg.d_model) as f64;
    tokens as f64 * (6.0 * params as f64 + attn)
}

fn out_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../target")));
    target.join("scaling")
}

struct ModelRow {
    name: &'static str,
    cfg: GptConfig,
    params: usize,
    tokens: usize,
    step_ms: f64,
    tokens_per_s: f64,
    model_gflops: f64,
    over_gemm: f64,
    over_reference: Option<f64>,
}

fn plot(
    path: &std::path::Path,
    mem: &[(usize, u64, u64)],
    models: &[ModelRow],
) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (1100, 450)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(550);
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    let ymax = mem
        .iter()
        .map(|m| mib(m.2).max(mib(m.1)))
        .fold(1.0, f64::max)
        * 1.1;
    let mut ch = ChartBuilder::on(&left)
        .caption("GPT-mini memory per rank vs W", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(0.5f64..8.5f64, 0f64..ymax)?;
    ch.configure_mesh().x_desc("ranks W").y_desc("MiB").draw()?;
    let state: Vec<(f64, f64)> = mem.iter().map(|m| (m.0 as f64, mib(m.1))).collect();
    let peak: Vec<(f64, f64)> = mem.iter().map(|m| (m.0 as f64, mib(m.2))).collect();
    ch.draw_series(LineSeries::new(state.clone(), &BLUE))?
        .label("params + grads + AdamW state (sharded)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], BLUE));
    ch.draw_series(state.iter().map(|p| Circle::new(*p, 4, BLUE.filled())))?;
    ch.draw_series(LineSeries::new(peak.clone(), &RED))?
        .label("peak allocated in the step")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], RED));
    ch.draw_series(peak.iter().map(|p| Circle::new(*p, 4, RED.filled())))?;
    ch.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;

    let xs: Vec<(f64, f64)> = models
        .iter()
        .map(|m| ((m.params as f64 / 1e6).log10(), m.tokens_per_s))
        .collect();
    let (x0, x1) = xs.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |a, p| {
        (a.0.min(p.0), a.1.max(p.0))
    });
    let tmax = xs.iter().map(|p| p.1).fold(1.0, f64::max) * 1.15;
    let mut ch = ChartBuilder::on(&right)
        .caption("tokens/s vs model size (W=4)", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d((x0 - 0.2)..(x1 + 0.2), 0f64..tmax)?;
    ch.configure_mesh()
        .x_desc("parameters (millions, log scale)")
        .x_label_formatter(&|v| format!("{:.1}", 10f64.powf(*v)))
        .y_desc("tokens/s")
        .draw()?;
    ch.draw_series(LineSeries::new(xs.clone(), &BLUE))?;
    ch.draw_series(xs.iter().map(|p| Circle::new(*p, 4, BLUE.filled())))?;
    ch.draw_series(models.iter().zip(&xs).map(|(m, p)| {
        Text::new(
            m.name.to_string(),
            (p.0, p.1 + tmax * 0.03),
            ("sans-serif", 13),
        )
    }))?;
    root.present()?;
    Ok(())
}

/// Both GEMM peaks (ours, then the reference), printed with `when`.
fn peaks(
    reference: Option<&'static ReferenceGemm>,
    cores: usize,
    when: &str,
) -> (Peak, Option<Peak>) {
    let ours = gemm_rates::peak(Impl::Ours, cores);
    let theirs = reference.map(|r| gemm_rates::peak(Impl::Reference(r), cores));
    for (who, p) in [("ours", Some(ours)), ("reference", theirs)] {
        if let Some(p) = p {
            println!(
                "gemm f32 1024³ ({when}), {who}: one {cores}-thread call {:.1} GFLOP/s, {cores} \
                 concurrent 1-thread calls {:.1} GFLOP/s, one core (thread CPU time) {:.1} GFLOP/s",
                p.all_cores, p.concurrent, p.one_core
            );
        }
    }
    (ours, theirs)
}

/// A JSON number, or `null` for `None` / a non-finite value.
fn num(v: Option<f64>, decimals: usize) -> String {
    match v {
        Some(x) if x.is_finite() => format!("{x:.decimals$}"),
        _ => "null".into(),
    }
}

/// A JSON string literal.
fn string(v: &str) -> String {
    format!("{v:?}")
}

/// (d): the per-shape table of every spec's products, ours vs the reference.
fn shape_table(
    specs: &[Spec],
    reference: Option<&'static ReferenceGemm>,
    cores: usize,
) -> Vec<ShapeRate> {
    let mut rows = Vec::new();
    for spec in specs {
        let threads = (cores / spec.world).max(1);
        let shapes = gemm_rates::model_shapes(spec.name, &spec.cfg, spec.batch * spec.cfg.seq_len);
        rows.extend(gemm_rates::shape_rates(&shapes, reference, threads, 3));
    }
    let threads: Vec<usize> = specs.iter().map(|s| (cores / s.world).max(1)).collect();
    println!(
        "\n(d) per-shape f32 GEMM rates at W=4 ({} thread(s) each, the rank's; timed on {}; ours \
         = matmul at {}, reference = {})",
        threads[0],
        gemm_rates::Clock::for_threads(threads[0]).name(),
        cpu_isa(),
        reference.map_or("none", |r| r.name())
    );
    println!(
        "{:<10} | {:<9} | {:>5} {:>5} {:>5} | {:>2} {:>2} | {:>11} | {:>11} | {:>10}",
        "model", "product", "m", "k", "n", "tA", "tB", "ours GF/s", "ref GF/s", "ours / ref"
    );
    for r in &rows {
        let s = &r.shape;
        println!(
            "{:<10} | {:<9} | {:>5} {:>5} {:>5} | {:>2} {:>2} | {:>11.1} | {:>11} | {:>10}",
            s.model,
            s.op,
            s.m,
            s.k,
            s.n,
            u8::from(s.trans_a),
            u8::from(s.trans_b),
            r.ours_gflops,
            num(r.reference_gflops, 1),
            num(r.ratio(), 3)
        );
    }
    for spec in specs {
        let mine: Vec<&ShapeRate> = rows.iter().filter(|r| r.shape.model == spec.name).collect();
        let (ours, theirs) = gemm_rates::aggregate(&mine);
        println!(
            "{:<10} all products (FLOP-weighted): ours {ours:.1} GFLOP/s, reference {} GFLOP/s, \
             ours / reference {}",
            spec.name,
            num(theirs, 1),
            num(theirs.map(|t| ours / t), 3)
        );
    }
    rows
}

/// The `shapes` rows and the per-model FLOP-weighted ratios of the JSON line.
fn shapes_json(specs: &[Spec], rows: &[ShapeRate]) -> (String, String) {
    let shape_json: Vec<String> = rows
        .iter()
        .map(|r| {
            let s = &r.shape;
            format!(
                "{{\"model\":\"{}\",\"product\":\"{}\",\"m\":{},\"k\":{},\"n\":{},\
                 \"trans_a\":{},\"trans_b\":{},\"ours_gflops\":{:.2},\"reference_gflops\":{},\
                 \"ours_over_reference\":{}}}",
                s.model,
                s.op,
                s.m,
                s.k,
                s.n,
                s.trans_a,
                s.trans_b,
                r.ours_gflops,
                num(r.reference_gflops, 2),
                num(r.ratio(), 4)
            )
        })
        .collect();
    let weighted: Vec<String> = specs
        .iter()
        .map(|spec| {
            let mine: Vec<&ShapeRate> =
                rows.iter().filter(|r| r.shape.model == spec.name).collect();
            let (ours, theirs) = gemm_rates::aggregate(&mine);
            format!("\"{}\":{}", spec.name, num(theirs.map(|t| ours / t), 4))
        })
        .collect();
    (shape_json.join(","), weighted.join(","))
}

fn main() -> Result<(), String> {
    // First, before any other thread exists: loading OpenBLAS may set OPENBLAS_CORETYPE for the
    // duration of the load (see `ReferenceGemm`).
    let reference = ReferenceGemm::load();
    let dir = out_dir();
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "scaling bench: {cores} cores; FullShard, Block units, BackwardPre, AdamW, f32; CPU \
         kernels at {} (detected {})",
        cpu_isa(),
        detected_cpu_isa()
    );
    let (reference, reference_note) = match reference {
        Ok(r) => {
            println!("reference GEMM: {}", r.name());
            (Some(r), None)
        }
        Err(e) => {
            println!("reference GEMM: none ({e})");
            (None, Some(e.to_string()))
        }
    };
    let shapes_only = std::env::var_os("SCALING_SHAPES_ONLY").is_some();
    let skip_124m = std::env::var_os("SCALING_SKIP_124M").is_some();

    let (mut ours_peak, mut ref_peak) = peaks(reference, cores, "before the runs");

    let mut specs = vec![
        Spec {
            name: "gpt-mini",
            cfg: GptConfig::mini(),
            world: 4,
            batch: 4,
            warmup: 2,
            steps: 6,
            trace: Some(dir.join("gpt_mini_w4_trace.json")),
        },
        Spec {
            name: "gpt-25m",
            cfg: GptConfig::new(256, 512, 8, 8, 128),
            world: 4,
            batch: 2,
            warmup: 1,
            steps: 3,
            trace: None,
        },
    ];
    if !skip_124m {
        specs.push(Spec {
            name: "gpt2-124m",
            cfg: GptConfig::new(50257, 768, 12, 12, 64),
            world: 4,
            batch: 1,
            warmup: 1,
            steps: 2,
            trace: None,
        });
    }
    let reference_json = |ref_peak: Option<Peak>| {
        format!(
            "\"gemm_reference\":{},\"gemm_reference_note\":{},\"cpu_isa\":\"{}\",\
             \"detected_cpu_isa\":\"{}\"",
            reference.map_or("null".into(), |r| string(r.name())),
            reference_note.as_deref().map_or("null".into(), string),
            cpu_isa(),
            detected_cpu_isa()
        ) + &format!(
            ",\"gemm_reference_flops_per_s\":{},\"gemm_reference_all_cores_gflops\":{},\
             \"gemm_reference_concurrent_gflops\":{},\"gemm_reference_one_core_gflops\":{}",
            num(ref_peak.map(|p| p.limit(cores) * 1e9), 0),
            num(ref_peak.map(|p| p.all_cores), 2),
            num(ref_peak.map(|p| p.concurrent), 2),
            num(ref_peak.map(|p| p.one_core), 2)
        )
    };

    if shapes_only {
        let rows = shape_table(&specs, reference, cores);
        let (shape_json, weighted) = shapes_json(&specs, &rows);
        println!(
            "{{\"gemm_peak_gflops\":{:.2},{},\"shapes_ours_over_reference\":{{{weighted}}},\
             \"shapes\":[{shape_json}]}}",
            ours_peak.measured(),
            reference_json(ref_peak),
        );
        return Ok(());
    }

    // (a) memory vs W.
    println!("\n(a) GPT-mini, 4 sequences per rank: per-rank memory vs W");
    println!(
        "{:>3} | {:>22} | {:>22} | {:>9}",
        "W", "sharded state (MiB)", "peak allocated (MiB)", "step ms"
    );
    let mut mem = Vec::new();
    for w in [1usize, 2, 4, 8] {
        let o = run(&Spec {
            name: "mini-mem",
            cfg: GptConfig::mini(),
            world: w,
            batch: 4,
            warmup: 1,
            steps: 1,
            trace: None,
        })?;
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        println!(
            "{w:>3} | {:>22.2} | {:>22.2} | {:>9.1}",
            mib(o.sharded_state_bytes),
            mib(o.peak_allocated_bytes),
            median(o.step_secs.clone()) * 1e3
        );
        mem.push((w, o.sharded_state_bytes, o.peak_allocated_bytes));
    }
    let w8_over_w1 = mem[3].1 as f64 / mem[0].1 as f64;
    println!("sharded state W=8 / W=1 = {w8_over_w1:.4} (1/8 = 0.125)");

    // (b) + (c) models at W=4.
    println!("\n(b, c) W=4: step time, tokens/s, model FLOP rate");
    let mut outcomes = Vec::new();
    for (i, s) in specs.iter().enumerate() {
        outcomes.push(run(s)?);
        if i == 0 {
            // Measured again right after GPT-mini (the ratios' denominators), best of both: on a
            // shared machine the load can change during the run.
            let (o, r) = peaks(reference, cores, "after GPT-mini");
            ours_peak = ours_peak.best(o);
            ref_peak = ref_peak.zip(r).map(|(a, b)| a.best(b));
        }
    }
    let gemm_peak_gflops = ours_peak.measured();
    let ref_gflops = ref_peak.map(|p| p.limit(cores));
    println!(
        "gemm peak (best of the above): ours {gemm_peak_gflops:.1} GFLOP/s (measured); reference \
         limit {} GFLOP/s (the best measured, or {cores} cores at its one-core rate)",
        num(ref_gflops, 1)
    );
    let mut rows = Vec::new();
    for (s, o) in specs.iter().zip(outcomes) {
        let tokens = s.world * s.batch * s.cfg.seq_len;
        let secs = median(o.step_secs.clone());
        let gflops = model_flops(&s.cfg, o.params, tokens) / secs / 1e9;
        rows.push(ModelRow {
            name: s.name,
            cfg: s.cfg,
            params: o.params,
            tokens,
            step_ms: secs * 1e3,
            tokens_per_s: tokens as f64 / secs,
            model_gflops: gflops,
            over_gemm: gflops / gemm_peak_gflops,
            over_reference: ref_gflops.map(|r| gflops / r),
        });
    }
    println!(
        "{:<10} | {:>8} | {:>6} | {:>9} | {:>9} | {:>12} | {:>9} | {:>13}",
        "model",
        "params M",
        "tokens",
        "step ms",
        "tokens/s",
        "model GFLOP/s",
        "over gemm",
        "over reference"
    );
    for r in &rows {
        println!(
            "{:<10} | {:>8.2} | {:>6} | {:>9.1} | {:>9.0} | {:>12.1} | {:>9.3} | {:>13}",
            r.name,
            r.params as f64 / 1e6,
            r.tokens,
            r.step_ms,
            r.tokens_per_s,
            r.model_gflops,
            r.over_gemm,
            num(r.over_reference, 3)
        );
    }
    let svg = dir.join("scaling.svg");
    plot(&svg, &mem, &rows).map_err(|e| format!("writing {}: {e}", svg.display()))?;
    println!("plot written to {}", svg.display());

    let shape_rows = shape_table(&specs, reference, cores);
    let (shape_json, weighted) = shapes_json(&specs, &shape_rows);

    let mem_json: Vec<String> = mem
        .iter()
        .map(|(w, s, p)| {
            format!("{{\"world\":{w},\"sharded_state_bytes\":{s},\"peak_allocated_bytes\":{p}}}")
        })
        .collect();
    let model_json: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{{\"model\":\"{}\",\"params\":{},\"d_model\":{},\"n_layers\":{},\"seq_len\":{},\
                 \"world\":4,\"tokens_per_step\":{},\"step_ms\":{:.2},\"tokens_per_s\":{:.1},\
                 \"model_gflops\":{:.2},\"model_flops_over_gemm\":{:.4},\
                 \"model_flops_over_reference_gemm\":{}}}",
                r.name,
                r.params,
                r.cfg.d_model,
                r.cfg.n_layers,
                r.cfg.seq_len,
                r.tokens,
                r.step_ms,
                r.tokens_per_s,
                r.model_gflops,
                r.over_gemm,
                num(r.over_reference, 4)
            )
        })
        .collect();
    println!(
        "{{\"model_flops_over_gemm\":{:.4},\"gemm_peak_gflops\":{:.2},\"gemm_2thread_gflops\":{:.2},\
         \"gemm_2x1thread_gflops\":{:.2},\"model_flops_over_reference_gemm\":{},{},\
         \"sharded_state_bytes_w8_over_w1\":{:.4},\"memory\":[{}],\"models\":[{}],\
         \"shapes_ours_over_reference\":{{{weighted}}},\"shapes\":[{shape_json}]}}",
        rows[0].over_gemm,
        gemm_peak_gflops,
        ours_peak.all_cores,
        ours_peak.concurrent,
        num(rows[0].over_reference, 4),
        reference_json(ref_peak),
        w8_over_w1,
        mem_json.join(","),
        model_json.join(",")
    );
    Ok(())
}
