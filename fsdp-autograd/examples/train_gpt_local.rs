//! Trains a small GPT on one CPU device on a synthetic, learnable task and prints the loss of
//! every step.
//!
//! The task: every sequence walks a fixed random permutation of the vocabulary (the next token is
//! a function of the current one), so the loss can fall from ln(vocab) towards 0.
//!
//! ```text
//! cargo run --release -p fsdp-autograd --example train_gpt_local -- [--steps 200] [--batch 8]
//!     [--lr 0.1] [--vocab 32] [--d-model 32] [--layers 2] [--heads 2] [--seq 16]
//!     [--tied] [--checkpoint] [--seed 0]
//! ```

use std::process::ExitCode;
use std::time::Instant;

use fsdp_alloc::Device;
use fsdp_autograd::nn::{parameters, Gpt, GptConfig, Module};
use fsdp_autograd::optim::Sgd;
use fsdp_autograd::{cross_entropy, InitContext, Result, Tensor};

struct Args {
    steps: usize,
    batch: usize,
    lr: f32,
    seed: u64,
    cfg: GptConfig,
}

fn parse() -> std::result::Result<Args, String> {
    let mut a = Args {
        steps: 200,
        batch: 8,
        lr: 0.1,
        seed: 0,
        cfg: GptConfig::tiny(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = |name: &str| -> std::result::Result<String, String> {
            it.next().ok_or_else(|| format!("{name} needs a value"))
        };
        let num = |s: String, name: &str| -> std::result::Result<usize, String> {
            s.parse()
                .map_err(|_| format!("{name}: `{s}` is not a number"))
        };
        match flag.as_str() {
            "--steps" => a.steps = num(val("--steps")?, "--steps")?,
            "--batch" => a.batch = num(val("--batch")?, "--batch")?,
            "--vocab" => a.cfg.vocab = num(val("--vocab")?, "--vocab")?,
            "--d-model" => a.cfg.d_model = num(val("--d-model")?, "--d-model")?,
            "--layers" => a.cfg.n_layers = num(val("--layers")?, "--layers")?,
            "--heads" => a.cfg.n_heads = num(val("--heads")?, "--heads")?,
            "--seq" => a.cfg.seq_len = num(val("--seq")?, "--seq")?,
            "--seed" => a.seed = num(val("--seed")?, "--seed")? as u64,
            "--lr" => {
                let s = val("--lr")?;
                a.lr = s
                    .parse()
                    .map_err(|_| format!("--lr: `{s}` is not a number"))?
            }
            "--tied" => a.cfg.tied = true,
            "--checkpoint" => a.cfg.checkpoint = true,
            "--gelu" => a.cfg.gelu = val("--gelu")?.parse()?,
            "-h" | "--help" => {
                return Err(
                    "usage: train_gpt_local [--steps N] [--batch B] [--lr LR] [--vocab V] \
                            [--d-model D] [--layers L] [--heads H] [--seq T] [--tied] \
                            [--checkpoint] [--seed S] [--gelu exact|tanh]"
                        .into(),
                )
            }
            other => return Err(format!("unknown argument `{other}` (try --help)")),
        }
    }
    Ok(a)
}

/// A tiny deterministic generator for the data.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

fn run(a: &Args) -> Result<()> {
    let dev = Device::cpu(0);
    let model = Gpt::new(&InitContext::eager(&dev, a.seed), &a.cfg)?;
    let n_params: usize = parameters(&model).iter().map(|p| p.numel()).sum();
    println!(
        "GPT: vocab {} d_model {} layers {} heads {} seq {} tied {} checkpoint {} gelu {} — {n_params} parameters",
        a.cfg.vocab, a.cfg.d_model, a.cfg.n_layers, a.cfg.n_heads, a.cfg.seq_len, a.cfg.tied, a.cfg.checkpoint, a.cfg.gelu
    );
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ a.seed);
    let mut perm: Vec<usize> = (0..a.cfg.vocab).collect();
    for i in (1..perm.len()).rev() {
        perm.swap(i, rng.below(i + 1));
    }
    let mut opt = Sgd::new(parameters(&model), a.lr).with_momentum(0.9);
    let t0 = Instant::now();
    for step in 0..a.steps {
        let (t, b) = (a.cfg.seq_len, a.batch);
        let (mut ids, mut tg) = (Vec::with_capacity(b * t), Vec::with_capacity(b * t));
        for _ in 0..b {
            let mut tok = rng.below(a.cfg.vocab);
            for _ in 0..t {
                ids.push(tok as i64);
                tok = perm[tok];
                tg.push(tok as i64);
            }
        }
        let ids = Tensor::from_vec(ids, &[b, t], &dev)?;
        let tg = Tensor::from_vec(tg, &[b, t], &dev)?;
        let loss = cross_entropy(&model.call(&ids)?, &tg)?;
        loss.backward()?;
        opt.step()?;
        opt.zero_grad();
        println!("step {step:4}  loss {:.4}", loss.item()?);
    }
    let stats = dev.memory_stats();
    println!(
        "{} steps in {:.2} s; device memory: {} bytes allocated, peak {}",
        a.steps,
        t0.elapsed().as_secs_f64(),
        stats.allocated_bytes,
        stats.peak_allocated_bytes
    );
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
