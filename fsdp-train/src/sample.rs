//! Text generation with a KV cache: `train_gpt sample` and `--sample-every N`.
//!
//! The model family's decoder ([`crate::model::Family::decoder`], e.g. GPT's
//! `GptDecoder` in `model/gpt.rs`) runs a plain (unwrapped) model one token at a time with a KV
//! cache; this module feeds it the prompt and picks the next tokens. The model may live on any
//! device (`train_gpt sample --device cuda` puts it on the first GPU: its layers run there, the
//! cached attention on the host); nothing is dropped (sampling never sets a dropout key).
//!
//! Sampling is deterministic for a seed: logits divided by the temperature, the `top_k` largest
//! kept, softmax in f64, and one uniform draw per token from a SplitMix64 stream of the seed
//! (temperature 0: the arg-max).

use std::path::{Path, PathBuf};

use clap::Parser;
use fsdp_alloc::Device;
use fsdp_core::checkpoint;
use fsdp_core::state_dict::{FullStateDict, ShardedStateDict, TensorEntry};

use crate::job::CudaLaunch;
use crate::model::{Decode, ModelSpec};
use crate::tokenizer::{beside, parse_tokenizer, Tokenizer, TokenizerArg};

type Res<T> = Result<T, String>;

fn e(err: impl std::fmt::Display) -> String {
    err.to_string()
}

/// How to pick tokens.
#[derive(Debug, Clone, Copy)]
pub struct SampleOpts {
    /// Tokens to generate.
    pub max_new_tokens: usize,
    /// Softmax temperature (0: greedy).
    pub temperature: f32,
    /// Keep only the `k` most likely tokens.
    pub top_k: Option<usize>,
    /// Seed of the draws.
    pub seed: u64,
    /// Only ids below this are drawn (the tokenizer's vocabulary when the model's is padded).
    pub max_id: usize,
}

/// SplitMix64: the next state and a uniform f64 in `[0, 1)`.
fn uniform(state: &mut u64) -> f64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// Picks the next token from `logits`.
fn pick(logits: &[f32], o: &SampleOpts, rng: &mut u64) -> u32 {
    let n = o.max_id.min(logits.len());
    let mut idx: Vec<usize> = (0..n).collect();
    // Largest first; ties by id (deterministic).
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if o.temperature <= 0.0 {
        return idx[0] as u32;
    }
    idx.truncate(o.top_k.unwrap_or(n).clamp(1, n));
    let t = o.temperature as f64;
    let top = logits[idx[0]] as f64 / t;
    let w: Vec<f64> = idx
        .iter()
        .map(|&i| (logits[i] as f64 / t - top).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let mut u = uniform(rng) * total;
    for (&i, &wi) in idx.iter().zip(&w) {
        if u < wi {
            return i as u32;
        }
        u -= wi;
    }
    *idx.last().expect("at least one candidate") as u32
}

/// Feeds `prompt` (at least one token) to a fresh decoder `dec` and generates
/// `o.max_new_tokens` more; returns the new tokens.
///
/// # Errors
/// An empty prompt; [`Decode::step`]'s errors.
pub fn generate(dec: &mut dyn Decode, prompt: &[u32], o: &SampleOpts) -> Res<Vec<u32>> {
    let mut out = Vec::with_capacity(o.max_new_tokens);
    generate_with(dec, prompt, o, &mut |t| {
        out.push(t);
        Ok(())
    })?;
    Ok(out)
}

/// [`generate`], handing each new token to `on_token` as soon as it is drawn (`train_gpt
/// sample` prints it then: a long generation streams instead of printing at the end).
///
/// # Errors
/// As [`generate`], and `on_token`'s.
pub fn generate_with(
    dec: &mut dyn Decode,
    prompt: &[u32],
    o: &SampleOpts,
    on_token: &mut dyn FnMut(u32) -> Res<()>,
) -> Res<()> {
    let (&last, head) = prompt
        .split_last()
        .ok_or("the prompt must hold at least one token")?;
    for &t in head {
        dec.step(t)?;
    }
    let mut rng = o.seed;
    let mut logits = dec.step(last)?;
    for i in 0..o.max_new_tokens {
        let t = pick(&logits, o, &mut rng);
        on_token(t)?;
        if i + 1 < o.max_new_tokens {
            logits = dec.step(t)?;
        }
    }
    Ok(())
}

/// Text decoded from bytes that arrive in pieces (a GPT-2 token may end inside a UTF-8
/// character): each [`Utf8Stream::push`] returns what can be shown so far, holding back an
/// incomplete character; together with [`Utf8Stream::finish`] the pieces equal
/// `String::from_utf8_lossy` of all the bytes.
#[derive(Debug, Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// Adds `bytes`; returns the text complete so far (invalid bytes as U+FFFD).
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..good]).unwrap_or_default());
                    match e.error_len() {
                        // An incomplete character at the end: wait for the rest.
                        None => {
                            self.pending.drain(..good);
                            return out;
                        }
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..good + bad);
                        }
                    }
                }
            }
        }
    }

    /// What is left (an incomplete character at the very end, as U+FFFD).
    pub fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }
}

/// The prompt's ids: `text` encoded, or one start token ([`Tokenizer::start`]: `<|endoftext|>`
/// for GPT-2, a newline for bytes, a `tokenizer.json`'s start-of-text token) when empty.
pub fn prompt_ids(tok: &Tokenizer, text: &str) -> Res<Vec<u32>> {
    let ids = tok.encode(text)?;
    Ok(if ids.is_empty() {
        vec![tok.start()?]
    } else {
        ids
    })
}

/// The model of the newest checkpoint in `root` that loads: its config (from `train_gpt`'s
/// metadata) and parameters (every rank's pieces of the sharded model directory, assembled,
/// every tensor's CRC-32 checked). A damaged newer checkpoint is skipped and reported to
/// `skipped` (its directory and problem); the one used is returned.
///
/// # Errors
/// No checkpoint that loads (naming the newest problem), or a directory that cannot be listed.
pub fn load_checkpoint(
    root: &Path,
    skipped: &mut dyn FnMut(&Path, &str),
) -> Res<(PathBuf, ModelSpec, FullStateDict)> {
    let dirs = checkpoint::candidates(root).map_err(e)?;
    let mut newest_problem = None;
    for dir in dirs {
        let loaded = checkpoint::check_complete(&dir)
            .map_err(e)
            .and_then(|()| load_model_dir(&dir));
        match loaded {
            Ok((g, full)) => return Ok((dir, g, full)),
            Err(why) => {
                skipped(&dir, &why);
                newest_problem.get_or_insert(why);
            }
        }
    }
    Err(match newest_problem {
        None => format!("--checkpoint-dir {}: no checkpoint in it", root.display()),
        Some(why) => format!(
            "--checkpoint-dir {}: no checkpoint loads (the newest: {why})",
            root.display()
        ),
    })
}

/// The model config and parameters of checkpoint `dir`.
fn load_model_dir(dir: &Path) -> Res<(ModelSpec, FullStateDict)> {
    let meta = crate::ckpt::peek(dir).map_err(e)?;
    let model = meta["fingerprint"]["model"]
        .as_str()
        .ok_or_else(|| format!("{}: no model in the checkpoint's metadata", dir.display()))?;
    let g = ModelSpec::parse(model)?;
    let sd = ShardedStateDict::load_dir(dir.join("model")).map_err(e)?;
    let mut entries = Vec::with_capacity(sd.params.len());
    for p in &sd.params {
        let mut values = vec![0.0f32; p.numel()];
        let mut filled = 0;
        for piece in sd.pieces.iter().filter(|x| x.name == p.name) {
            values[piece.offset..piece.offset + piece.values.len()].copy_from_slice(&piece.values);
            filled += piece.values.len();
        }
        if filled != values.len() {
            return Err(format!(
                "{}: parameter `{}` has {filled} of {} values",
                dir.display(),
                p.name,
                values.len()
            ));
        }
        entries.push(TensorEntry {
            name: p.name.clone(),
            shape: p.shape.clone(),
            values,
        });
    }
    Ok((
        g,
        FullStateDict {
            world_size: 1,
            entries,
        },
    ))
}

/// `train_gpt sample`: generates text from a checkpoint or Hugging Face GPT-2 or Llama weights.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "train_gpt sample",
    bin_name = "train_gpt sample",
    about = "Generates text from the newest complete checkpoint of --checkpoint-dir, or from Hugging Face GPT-2 or Llama weights (--init-from), with a KV cache, on the CPU or (--device cuda) the first GPU",
    max_term_width = 100
)]
pub struct SampleCli {
    /// Checkpoint root (train_gpt --checkpoint-dir): its newest complete checkpoint
    #[arg(long, value_name = "DIR", conflicts_with = "init_from")]
    pub checkpoint_dir: Option<PathBuf>,
    /// A Hugging Face GPT-2 or Llama model directory (weights + config.json) or its
    /// model.safetensors
    #[arg(long, value_name = "PATH")]
    pub init_from: Option<PathBuf>,
    /// Text to continue (default: a start token)
    #[arg(long, value_name = "TEXT", default_value = "")]
    pub prompt: String,
    /// Tokens to generate
    #[arg(long, value_name = "N", default_value_t = 100,
          value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub max_new_tokens: u64,
    /// Softmax temperature (0: always the most likely token)
    #[arg(long, value_name = "T", default_value_t = 0.8, value_parser = parse_temperature)]
    pub temperature: f32,
    /// Draw only among the K most likely tokens
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
    pub top_k: Option<u64>,
    /// Seed of the draws (same seed, same text)
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// bytes, gpt2 or PATH/tokenizer.json (default: the --init-from directory's tokenizer.json
    /// when there is one, else gpt2 when the model's vocab holds GPT-2's 50257 ids, else bytes)
    #[arg(long, value_name = "bytes|gpt2|PATH", value_parser = parse_tokenizer)]
    pub tokenizer: Option<TokenizerArg>,
    /// Where the model runs: cpu, or cuda (the first GPU; needs a build with --features
    /// fsdp-train/cuda). Without a CUDA driver, cuda exits with one line naming what is missing
    #[arg(long, value_name = "DEVICE", default_value = "cpu", value_parser = ["cpu", "cuda"])]
    pub device: String,
}

/// The device `--device` names: `cpu:0`, or `cuda:0` after the same preflight as training's
/// (a typed error when the build has no CUDA support or there is no driver or GPU).
///
/// # Errors
/// One line naming what is missing.
pub fn sample_device(arg: &str) -> Res<Device> {
    match arg {
        "cuda" => {
            crate::cuda::preflight(CudaLaunch::Threads)
                .map_err(|err| format!("--device cuda: {err}"))?;
            Device::cuda(0).map_err(|err| format!("--device cuda: {err}"))
        }
        _ => Ok(Device::cpu(0)),
    }
}

fn parse_temperature(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(t) if t.is_finite() && (0.0..=100.0).contains(&t) => Ok(t),
        _ => Err(format!("`{s}` is not a temperature in 0..=100")),
    }
}

/// Runs `train_gpt sample` (arguments after `sample`); prints the prompt and the continuation.
///
/// # Errors
/// One line saying what went wrong.
pub fn run(cli: SampleCli) -> Res<()> {
    let (source, g, full) = match (&cli.checkpoint_dir, &cli.init_from) {
        (Some(root), None) => {
            match std::fs::metadata(root) {
                Ok(m) if m.is_dir() => {}
                Ok(m) => {
                    return Err(format!(
                        "--checkpoint-dir {}: it is {}, not a directory; give train_gpt's \
                         --checkpoint-dir",
                        root.display(),
                        crate::data::file_kind(m.file_type())
                    ))
                }
                Err(err) => return Err(format!("--checkpoint-dir {}: {err}", root.display())),
            }
            let (dir, g, full) = load_checkpoint(root, &mut |dir, why| {
                eprintln!("sample: skipped {}: {why}", dir.display());
            })?;
            eprintln!("sample: using checkpoint {}", dir.display());
            (dir.display().to_string(), g, full)
        }
        (None, Some(p)) => {
            // Sampling drops nothing: the decoder's model gets no dropout key.
            let (g, note) = ModelSpec::from_hf(p)?;
            let full = g.hf_full(p)?;
            (note, g, full)
        }
        _ => return Err("give --checkpoint-dir DIR or --init-from PATH".into()),
    };
    let tok = match (&cli.tokenizer, cli.init_from.as_deref().and_then(beside)) {
        (Some(t), _) => t.load()?,
        (None, Some(p)) => Tokenizer::json(&p)?,
        (None, None) if g.vocab() >= Tokenizer::Gpt2.vocab() => Tokenizer::Gpt2,
        (None, None) => Tokenizer::Bytes,
    };
    if g.vocab() < tok.vocab() {
        return Err(format!(
            "the model's vocab {} is smaller than the tokenizer {}'s {}",
            g.vocab(),
            tok.name(),
            tok.vocab()
        ));
    }
    let dev = sample_device(&cli.device)?;
    let mut dec = g.decoder(&full, &dev)?;
    let prompt = prompt_ids(&tok, &cli.prompt)?;
    let o = SampleOpts {
        max_new_tokens: cli.max_new_tokens as usize,
        temperature: cli.temperature,
        top_k: cli.top_k.map(|k| k as usize),
        seed: cli.seed,
        max_id: tok.vocab(),
    };
    eprintln!(
        "sample: {source} ({} vocab {} d {} layers {}) on {}, tokenizer {}, {} prompt + {} new tokens, temperature {}, top-k {}, seed {}",
        g.name(),
        g.vocab(),
        g.d_model(),
        g.n_layers(),
        dev.id(),
        tok.name(),
        prompt.len(),
        o.max_new_tokens,
        o.temperature,
        o.top_k.map_or("all".into(), |k| k.to_string()),
        o.seed
    );
    // The prompt, then each token as it is drawn (a character split over tokens is printed
    // when it is complete).
    print!("{}", cli.prompt);
    let mut text = Utf8Stream::default();
    generate_with(dec.as_mut(), &prompt, &o, &mut |t| {
        print!("{}", text.push(&tok.decode_bytes(&[t])?));
        crate::out::flush_stdout();
        Ok(())
    })?;
    println!("{}", text.finish());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::GptDecoder;
    use fsdp_autograd::nn::{Gpt, GptConfig};
    use fsdp_autograd::InitContext;

    /// A fresh decoder over the same (seed 5) GPT.
    fn dec() -> GptDecoder {
        let dev = Device::cpu(0);
        let g = GptConfig::new(48, 32, 2, 4, 12);
        GptDecoder::new(Gpt::new(&InitContext::eager(&dev, 5), &g).unwrap()).unwrap()
    }

    #[test]
    fn sampling_is_deterministic_per_seed_and_greedy_at_zero() {
        let mut o = SampleOpts {
            max_new_tokens: 30, // more than seq_len 12: the context wraps
            temperature: 1.0,
            top_k: Some(10),
            seed: 7,
            max_id: 40,
        };
        let a = generate(&mut dec(), &[1, 2], &o).unwrap();
        assert_eq!(a, generate(&mut dec(), &[1, 2], &o).unwrap());
        assert_eq!(a.len(), 30);
        assert!(a.iter().all(|&t| t < 40));
        o.seed = 8;
        assert_ne!(a, generate(&mut dec(), &[1, 2], &o).unwrap());
        o.temperature = 0.0;
        let g = generate(&mut dec(), &[1, 2], &o).unwrap();
        let mut d = dec();
        d.step(1).unwrap();
        let l = d.step(2).unwrap();
        let best = (0..40)
            .max_by(|&a, &b| l[a].total_cmp(&l[b]).then(b.cmp(&a)))
            .unwrap();
        assert_eq!(g[0], best as u32);
    }

    /// Issue #37 (10): text streamed token by token (a token may end inside a UTF-8
    /// character, or hold invalid bytes) comes out exactly as decoding all the bytes at once.
    #[test]
    fn streamed_text_equals_the_whole_decode() {
        let bytes: Vec<u8> = "héllo wörld — ✓ ok"
            .bytes()
            .chain([0xff, b'a', 0xe2, 0x9c])
            .collect();
        let whole = String::from_utf8_lossy(&bytes).into_owned();
        for piece in [1, 2, 3, 5] {
            let mut s = Utf8Stream::default();
            let mut out = String::new();
            for c in bytes.chunks(piece) {
                out.push_str(&s.push(c));
            }
            out.push_str(&s.finish());
            assert_eq!(out, whole, "pieces of {piece}");
        }
        let mut s = Utf8Stream::default();
        assert_eq!(s.push(&[0xc3]), "", "half a character waits");
        assert_eq!(s.push(&[0xa9]), "é");
    }

    /// `--device cuda` without a GPU (or built without CUDA) is one line naming what is
    /// missing.
    #[test]
    fn a_missing_gpu_is_one_line() {
        if Device::cuda(0).is_err() {
            let err = sample_device("cuda").unwrap_err();
            assert!(
                err.starts_with("--device cuda: ") && !err.contains('\n'),
                "{err}"
            );
        }
    }
}
