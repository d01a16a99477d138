//! GPT-mini forward + backward on one CPU device (one rank), matmuls on 2 threads.
//!
//! Model: vocab 256, d_model 256, 4 layers, 4 heads, seq 128, batch 16, f32.
//! Reports (last stdout line, one JSON object):
//! - `step_ms_median`, `tokens_per_s`: forward + loss + backward, synchronized, median of steps;
//! - `matmul_gflops`: our `Tensor::matmul` op on the step's linear-layer product shapes (forward
//!   `x·Wᵀ`, backward `dy·W` and `dyᵀ·x`), each timed end to end from launch to completion,
//!   weighted by how often the step runs each shape (each side: best of 3 alternating rounds);
//! - `gemm_raw_gflops`: the `gemm` crate called directly on the same shapes, transposes and
//!   parallelism, in the same run; `matmul_over_raw` = the ratio (target ≥ 0.9);
//! - `breakdown_ms_per_step`: time measured inside stream work per operation type, per step, plus
//!   `launch_and_idle` = step time minus the kernels' total.

use std::time::{Duration, Instant};

use fsdp_alloc::{DType, Device};
use fsdp_autograd::kernels::cpu::{matmul_parallelism, set_matmul_threads};
use fsdp_autograd::nn::{parameters, Gpt, GptConfig, Module};
use fsdp_autograd::{cross_entropy, profile, InitContext, Tensor};

const BATCH: usize = 16;
const THREADS: usize = 2;
const WARMUP: usize = 2;
const STEPS: usize = 8;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// xorshift data.
fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

/// One product shape of the step: C[m×n] = op(A)·op(B), and how often a step runs it.
#[derive(Clone, Copy, Debug)]
struct Shape {
    m: usize,
    k: usize,
    n: usize,
    ta: bool,
    tb: bool,
    count: usize,
}

fn step_shapes(cfg: &GptConfig, rows: usize) -> Vec<Shape> {
    let d = cfg.d_model;
    // (in, out, uses per step) of every linear layer.
    let layers = [
        (d, 3 * d, cfg.n_layers),
        (d, d, cfg.n_layers),
        (d, 4 * d, cfg.n_layers),
        (4 * d, d, cfg.n_layers),
        (d, cfg.vocab, 1),
    ];
    let mut v = Vec::new();
    for (i, o, c) in layers {
        // forward y = x·Wᵀ, backward dx = dy·W, dW = dyᵀ·x
        v.push(Shape {
            m: rows,
            k: i,
            n: o,
            ta: false,
            tb: true,
            count: c,
        });
        v.push(Shape {
            m: rows,
            k: o,
            n: i,
            ta: false,
            tb: false,
            count: c,
        });
        v.push(Shape {
            m: o,
            k: rows,
            n: i,
            ta: true,
            tb: false,
            count: c,
        });
    }
    v
}

fn flops(s: &Shape) -> f64 {
    2.0 * (s.m * s.k * s.n) as f64
}

/// Our op on one shape, launched `reps` times and synchronized: seconds per product.
fn time_ours(dev: &Device, s: &Shape, reps: usize) -> f64 {
    // Store A as (m×k) or, for ta, as (k×m) and view it transposed; same for B.
    let a_store = if s.ta { [s.k, s.m] } else { [s.m, s.k] };
    let b_store = if s.tb { [s.n, s.k] } else { [s.k, s.n] };
    let a = Tensor::from_vec(data(s.m * s.k, 1), &a_store, dev).unwrap();
    let b = Tensor::from_vec(data(s.k * s.n, 2), &b_store, dev).unwrap();
    let a = if s.ta { a.t().unwrap() } else { a };
    let b = if s.tb { b.t().unwrap() } else { b };
    dev.synchronize().unwrap();
    let _ = a.matmul(&b).unwrap(); // warm the allocator cache
    dev.synchronize().unwrap();
    let t = Instant::now();
    for _ in 0..reps {
        let _c = a.matmul(&b).unwrap();
    }
    dev.synchronize().unwrap();
    t.elapsed().as_secs_f64() / reps as f64
}

/// `gemm` directly with the same storage, strides and parallelism: seconds per product.
fn time_raw(s: &Shape, reps: usize) -> f64 {
    let a = data(s.m * s.k, 1);
    let b = data(s.k * s.n, 2);
    let mut c = vec![0.0f32; s.m * s.n];
    // Row-major storage: A (m×k) rs=k cs=1, transposed storage (k×m) rs=1 cs=m; same for B.
    let (a_rs, a_cs) = if s.ta {
        (1, s.m as isize)
    } else {
        (s.k as isize, 1)
    };
    let (b_rs, b_cs) = if s.tb {
        (1, s.k as isize)
    } else {
        (s.n as isize, 1)
    };
    let run = |c: &mut [f32]| {
        // SAFETY: a holds m·k, b k·n and c m·n elements; the strides address exactly those
        // row-major (or transposed row-major) layouts, and the three buffers do not overlap.
        unsafe {
            gemm::gemm(
                s.m,
                s.n,
                s.k,
                c.as_mut_ptr(),
                1,
                s.n as isize,
                false,
                a.as_ptr(),
                a_cs,
                a_rs,
                b.as_ptr(),
                b_cs,
                b_rs,
                0.0,
                1.0,
                false,
                false,
                false,
                matmul_parallelism(),
            )
        }
    };
    run(&mut c);
    let t = Instant::now();
    for _ in 0..reps {
        run(&mut c);
    }
    std::hint::black_box(&c);
    t.elapsed().as_secs_f64() / reps as f64
}

fn main() {
    set_matmul_threads(THREADS);
    let dev = Device::cpu(0);
    let cfg = GptConfig::mini();
    let model = Gpt::new(&InitContext::eager(&dev, 0), &cfg).unwrap();
    let params = parameters(&model);
    let n_tokens = BATCH * cfg.seq_len;
    let ids: Vec<i64> = data(n_tokens, 3)
        .iter()
        .map(|v| ((v + 0.5) * 255.0) as i64)
        .collect();
    let targets: Vec<i64> = ids
        .iter()
        .map(|&i| (i * 7 + 1) % cfg.vocab as i64)
        .collect();
    let ids = Tensor::from_vec(ids, &[BATCH, cfg.seq_len], &dev).unwrap();
    let targets = Tensor::from_vec(targets, &[BATCH, cfg.seq_len], &dev).unwrap();

    let step = || -> (f64, f32) {
        for p in &params {
            p.get().unwrap().zero_grad();
        }
        let t = Instant::now();
        let logits = model.call(&ids).unwrap();
        let loss = cross_entropy(&logits, &targets).unwrap();
        loss.backward().unwrap();
        dev.synchronize().unwrap();
        let ms = t.elapsed().as_secs_f64() * 1e3;
        (ms, loss.item().unwrap())
    };
    for _ in 0..WARMUP {
        step();
    }
    let mut times = Vec::new();
    let mut loss = 0.0;
    for _ in 0..STEPS {
        let (ms, l) = step();
        times.push(ms);
        loss = l;
    }
    let step_ms = median(times.clone());
    println!("step times (ms): {times:.1?}; loss {loss:.4}");

    // Per-op breakdown over a few profiled steps.
    let _ = profile::take();
    profile::set_enabled(true);
    let prof_steps = 3;
    let mut prof_total = 0.0;
    for _ in 0..prof_steps {
        prof_total += step().0;
    }
    profile::set_enabled(false);
    let report = profile::take();
    let kernel_ms: f64 = report
        .iter()
        .map(|e| e.total.as_secs_f64() * 1e3)
        .sum::<f64>()
        / prof_steps as f64;
    let mut breakdown = String::new();
    for e in &report {
        let ms = e.total.as_secs_f64() * 1e3 / prof_steps as f64;
        println!(
            "  {:<24} {:>8.2} ms/step  ({} runs/step)",
            e.op,
            ms,
            e.count / prof_steps as u64
        );
        breakdown.push_str(&format!("\"{}\": {:.3}, ", e.op, ms));
    }
    let overhead = (prof_total / prof_steps as f64 - kernel_ms).max(0.0);
    breakdown.push_str(&format!("\"launch_and_idle\": {overhead:.3}"));
    let matmul_ms = report
        .iter()
        .filter(|e| e.op == "matmul")
        .map(|e| e.total)
        .sum::<Duration>()
        .as_secs_f64()
        * 1e3
        / prof_steps as f64;
    println!(
        "kernels {kernel_ms:.1} ms/step of {:.1} ms; matmul {matmul_ms:.1} ms ({:.0}%)",
        prof_total / prof_steps as f64,
        100.0 * matmul_ms / (prof_total / prof_steps as f64)
    );

    // Our matmul op vs raw gemm on the step's shapes.
    let shapes = step_shapes(&cfg, n_tokens);
    let (mut total_flops, mut ours_s, mut raw_s) = (0.0, 0.0, 0.0);
    for s in &shapes {
        // Alternate the two sides and keep each side's best round: robust to other load on
        // the machine, and both sides see the same conditions.
        let reps = 4;
        let (mut o, mut r) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..3 {
            o = o.min(time_ours(&dev, s, reps));
            r = r.min(time_raw(s, reps));
        }
        println!(
            "  {}x{}x{} ta={} tb={}: ours {:.2} ms ({:.1} GFLOP/s), raw {:.2} ms ({:.1} GFLOP/s)",
            s.m,
            s.k,
            s.n,
            s.ta,
            s.tb,
            o * 1e3,
            flops(s) / o / 1e9,
            r * 1e3,
            flops(s) / r / 1e9
        );
        total_flops += flops(s) * s.count as f64;
        ours_s += o * s.count as f64;
        raw_s += r * s.count as f64;
    }
    let ours_gflops = total_flops / ours_s / 1e9;
    let raw_gflops = total_flops / raw_s / 1e9;
    let dtype = DType::F32;
    println!(
        "{{\"bench\": \"autograd\", \"model\": \"gpt-mini vocab {} d {} layers {} heads {} seq {} batch {BATCH} {dtype}\", \"threads\": {THREADS}, \"step_ms_median\": {step_ms:.3}, \"tokens_per_s\": {:.1}, \"matmul_gflops\": {ours_gflops:.2}, \"gemm_raw_gflops\": {raw_gflops:.2}, \"matmul_over_raw\": {:.3}, \"matmul_share_of_step\": {:.3}, \"breakdown_ms_per_step\": {{{breakdown}}}}}",
        cfg.vocab,
        cfg.d_model,
        cfg.n_layers,
        cfg.n_heads,
        cfg.seq_len,
        n_tokens as f64 / (step_ms / 1e3),
        ours_gflops / raw_gflops,
        matmul_ms / (prof_total / prof_steps as f64),
    );
}
