//! Text generation with a KV cache: `train_gpt sample` and `--sample-every N`.
//!
//! [`Decoder`] runs a plain (unwrapped) [`Gpt`] one token at a time. Each block's layer norms,
//! `qkv` and output projections and MLP are the model's own modules, called on the one new
//! position (so they run on the model's device with its kernels); the attention of that
//! position over all earlier ones is computed on the host from the cached keys and values of
//! every layer (`2 · layers · t · d` floats, scaled as the layer's attention is:
//! [`GptConfig::attn_scale`]), so a step costs one position's forward instead of the whole
//! prefix's. When the context is full (the position table's [`GptConfig::positions`] tokens),
//! the cache is rebuilt from the last half. The model may live on any device (`train_gpt sample
//! --device cuda` puts it on the first GPU: its layers run there, the cached attention on the
//! host); nothing is dropped (sampling never sets a dropout key).
//!
//! Sampling is deterministic for a seed: logits divided by the temperature, the `top_k` largest
//! kept, softmax in f64, and one uniform draw per token from a SplitMix64 stream of the seed
//! (temperature 0: the arg-max).

use std::path::{Path, PathBuf};

use clap::Parser;
use fsdp_alloc::Device;
use fsdp_autograd::nn::{Gelu, Gpt, GptConfig, GptDropout, Module};
use fsdp_autograd::{no_grad, InitContext, Tensor};
use fsdp_core::checkpoint;
use fsdp_core::state_dict::{FullStateDict, ShardedStateDict, TensorEntry};

use crate::job::CudaLaunch;
use crate::tokenizer::{Tokenizer, GPT2_EOT};

/// The named child of `m`.
fn child<'a>(m: &'a dyn Module, name: &str) -> Result<&'a dyn Module, String> {
    let mut found = None;
    m.visit_children(&mut |n, c| {
        if n == name {
            found = Some(c);
        }
    });
    found.ok_or_else(|| format!("{} has no child `{name}`", m.type_name()))
}

/// One block's modules.
struct BlockParts<'m> {
    ln1: &'m dyn Module,
    qkv: &'m dyn Module,
    proj: &'m dyn Module,
    ln2: &'m dyn Module,
    mlp: &'m dyn Module,
}

/// Incremental decoding of a [`Gpt`] with a KV cache.
pub struct Decoder<'m> {
    model: &'m Gpt,
    blocks: Vec<BlockParts<'m>>,
    dev: Device,
    /// Per layer: keys and values, `[t, d]` each, row-major.
    cache: Vec<(Vec<f32>, Vec<f32>)>,
    /// The tokens in the cache.
    tokens: Vec<u32>,
}

type Res<T> = Result<T, String>;

fn e(err: impl std::fmt::Display) -> String {
    err.to_string()
}

impl<'m> Decoder<'m> {
    /// A decoder over `model` (its parameters must be materialized).
    ///
    /// # Errors
    /// A model that is not shaped like `nn::Gpt`'s blocks.
    pub fn new(model: &'m Gpt) -> Res<Decoder<'m>> {
        let mut blocks = Vec::new();
        for i in 0..model.config.n_layers {
            let b = child(&model.blocks, &i.to_string())?;
            let attn = child(b, "attn")?;
            blocks.push(BlockParts {
                ln1: child(b, "ln1")?,
                qkv: child(attn, "qkv")?,
                proj: child(attn, "proj")?,
                ln2: child(b, "ln2")?,
                mlp: child(b, "mlp")?,
            });
        }
        let dev = model.tok_emb.weight.get().map_err(e)?.device().clone();
        Ok(Decoder {
            model,
            blocks,
            dev,
            cache: vec![(Vec::new(), Vec::new()); model.config.n_layers],
            tokens: Vec::new(),
        })
    }

    /// Appends `token` at the next position and returns the logits of the token after it
    /// (`vocab` values). A full context is first shrunk to its last half.
    ///
    /// # Errors
    /// A token outside the vocabulary; tensor errors.
    pub fn step(&mut self, token: u32) -> Res<Vec<f32>> {
        let g = &self.model.config;
        if token as usize >= g.vocab {
            return Err(format!(
                "token id {token} is outside the model's vocab {}",
                g.vocab
            ));
        }
        let context = g.positions();
        if self.tokens.len() == context {
            let keep = self.tokens.split_off(context - context / 2);
            self.tokens.clear();
            for c in &mut self.cache {
                c.0.clear();
                c.1.clear();
            }
            for t in keep {
                self.step(t)?;
            }
        }
        no_grad(|| self.forward_one(token))
    }

    fn forward_one(&mut self, token: u32) -> Res<Vec<f32>> {
        let g = self.model.config;
        let (d, h) = (g.d_model, g.n_heads);
        let dh = d / h;
        let pos = self.tokens.len();
        let ids = Tensor::from_vec(vec![token as i64], &[1, 1], &self.dev).map_err(e)?;
        let at = Tensor::from_vec(vec![pos as i64], &[1], &self.dev).map_err(e)?;
        let mut x = self
            .model
            .tok_emb
            .call(&ids)
            .and_then(|t| t.add(&self.model.pos_emb.call(&at)?))
            .map_err(e)?;
        for (layer, (b, (keys, values))) in self.blocks.iter().zip(&mut self.cache).enumerate() {
            let scale = g.attn_scale(layer);
            let qkv = b
                .qkv
                .call(&b.ln1.call(&x).map_err(e)?)
                .and_then(|t| t.to_vec::<f32>())
                .map_err(e)?;
            let (q, kv) = qkv.split_at(d);
            keys.extend_from_slice(&kv[..d]);
            values.extend_from_slice(&kv[d..]);
            let t = pos + 1;
            let mut y = vec![0.0f32; d];
            let mut p = vec![0.0f32; t];
            for head in 0..h {
                let o = head * dh;
                let qh = &q[o..o + dh];
                let mut max = f32::NEG_INFINITY;
                for (i, s) in p.iter_mut().enumerate() {
                    let k = &keys[i * d + o..i * d + o + dh];
                    *s = qh.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale;
                    max = max.max(*s);
                }
                let mut sum = 0.0f32;
                for s in p.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                let yh = &mut y[o..o + dh];
                for (i, s) in p.iter().enumerate() {
                    let v = &values[i * d + o..i * d + o + dh];
                    for (yy, vv) in yh.iter_mut().zip(v) {
                        *yy += s / sum * vv;
                    }
                }
            }
            let y = Tensor::from_vec(y, &[1, 1, d], &self.dev).map_err(e)?;
            x = x.add(&b.proj.call(&y).map_err(e)?).map_err(e)?;
            let m = b.mlp.call(&b.ln2.call(&x).map_err(e)?).map_err(e)?;
            x = x.add(&m).map_err(e)?;
        }
        self.tokens.push(token);
        let x = self.model.ln_f.call(&x).map_err(e)?;
        self.model
            .head
            .call(&x)
            .and_then(|t| t.to_vec::<f32>())
            .map_err(e)
    }
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

/// Feeds `prompt` (at least one token) and generates `o.max_new_tokens` more; returns the new
/// tokens.
///
/// # Errors
/// An empty prompt; [`Decoder::step`]'s errors.
pub fn generate(model: &Gpt, prompt: &[u32], o: &SampleOpts) -> Res<Vec<u32>> {
    let mut out = Vec::with_capacity(o.max_new_tokens);
    generate_with(model, prompt, o, &mut |t| {
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
    model: &Gpt,
    prompt: &[u32],
    o: &SampleOpts,
    on_token: &mut dyn FnMut(u32) -> Res<()>,
) -> Res<()> {
    let (&last, head) = prompt
        .split_last()
        .ok_or("the prompt must hold at least one token")?;
    let mut dec = Decoder::new(model)?;
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

/// The prompt's ids: `text` encoded, or one start token (`<|endoftext|>` for GPT-2, a newline
/// for bytes) when empty.
pub fn prompt_ids(tok: Tokenizer, text: &str) -> Res<Vec<u32>> {
    let ids = tok.encode(text)?;
    Ok(if ids.is_empty() {
        vec![match tok {
            Tokenizer::Gpt2 => GPT2_EOT,
            Tokenizer::Bytes => u32::from(b'\n'),
        }]
    } else {
        ids
    })
}

/// A plain `Gpt` of `g` on `dev` holding `full`'s values: built on the fake device (nothing
/// initialized), then each parameter materialized on `dev` from its entry.
///
/// # Errors
/// An entry missing, of another shape, or left over; device errors.
pub fn model_from(g: &GptConfig, full: &FullStateDict, dev: &Device) -> Res<Gpt> {
    let model = Gpt::new(&InitContext::fake(0), &g.with_checkpoint(false)).map_err(e)?;
    let params = fsdp_autograd::nn::named_parameters(&model);
    for (name, p) in &params {
        let entry = full
            .get(name)
            .ok_or_else(|| format!("the weights have no parameter `{name}`"))?;
        if entry.shape != p.shape() {
            return Err(format!(
                "parameter `{name}` is {:?} in the weights, {:?} in the model",
                entry.shape,
                p.shape()
            ));
        }
        let t = Tensor::from_slice(&entry.values, &entry.shape, dev).map_err(e)?;
        p.materialize(t).map_err(e)?;
    }
    if let Some(extra) = full
        .entries
        .iter()
        .find(|x| !params.iter().any(|(n, _)| *n == x.name))
    {
        return Err(format!(
            "the weights have a parameter `{}` the model does not",
            extra.name
        ));
    }
    Ok(model)
}

/// The model string of `train_gpt`'s checkpoint fingerprint: `vocab V d D layers L heads H seq
/// T tied B gelu G`, then only what differs from a plain `GptConfig::new`: `positions N`,
/// `inner N`, `ln-eps E`, `attn-scale-head-dim B`, `attn-scale-inverse-layer B`, `dropout E A
/// R` (so checkpoints of models without these options keep their old fingerprint).
pub fn model_string(g: &GptConfig) -> String {
    let mut s = format!(
        "vocab {} d {} layers {} heads {} seq {} tied {} gelu {}",
        g.vocab,
        g.d_model,
        g.n_layers,
        g.n_heads,
        g.seq_len,
        g.tied,
        g.gelu.name()
    );
    let plain = GptConfig::new(g.vocab, g.d_model, g.n_layers, g.n_heads, g.seq_len);
    if g.positions() != plain.positions() {
        s += &format!(" positions {}", g.positions());
    }
    if g.inner() != plain.inner() {
        s += &format!(" inner {}", g.inner());
    }
    if g.ln_eps != plain.ln_eps {
        s += &format!(" ln-eps {}", g.ln_eps);
    }
    if g.attn_scaling.by_head_dim != plain.attn_scaling.by_head_dim {
        s += &format!(" attn-scale-head-dim {}", g.attn_scaling.by_head_dim);
    }
    if g.attn_scaling.by_inverse_layer != plain.attn_scaling.by_inverse_layer {
        s += &format!(
            " attn-scale-inverse-layer {}",
            g.attn_scaling.by_inverse_layer
        );
    }
    if !g.dropout.is_off() {
        let d = g.dropout;
        s += &format!(" dropout {} {} {}", d.embd, d.attn, d.resid);
    }
    s
}

/// Parses [`model_string`]'s text.
fn parse_model(s: &str) -> Res<GptConfig> {
    let w: Vec<&str> = s.split_whitespace().collect();
    let get = |k: &str| -> Res<&str> {
        w.iter()
            .position(|x| *x == k)
            .and_then(|i| w.get(i + 1).copied())
            .ok_or_else(|| format!("the checkpoint's model `{s}` has no `{k}`"))
    };
    let num =
        |k: &str| -> Res<usize> { get(k)?.parse().map_err(|_| format!("bad `{k}` in `{s}`")) };
    let gelu: Gelu = get("gelu")?.parse()?;
    let mut g = GptConfig::new(
        num("vocab")?,
        num("d")?,
        num("layers")?,
        num("heads")?,
        num("seq")?,
    )
    .with_tied(get("tied")? == "true")
    .with_gelu(gelu);
    let has = |k: &str| w.contains(&k);
    let float =
        |x: &str| -> Res<f32> { x.parse().map_err(|_| format!("bad number `{x}` in `{s}`")) };
    if has("positions") {
        g = g.with_positions(num("positions")?);
    }
    if has("inner") {
        g = g.with_inner(num("inner")?);
    }
    if has("ln-eps") {
        g = g.with_ln_eps(float(get("ln-eps")?)?);
    }
    if has("attn-scale-head-dim") {
        g.attn_scaling.by_head_dim = get("attn-scale-head-dim")? == "true";
    }
    if has("attn-scale-inverse-layer") {
        g.attn_scaling.by_inverse_layer = get("attn-scale-inverse-layer")? == "true";
    }
    if has("dropout") {
        let i = w.iter().position(|x| *x == "dropout").unwrap_or(0);
        let p: Vec<f32> = w
            .get(i + 1..i + 4)
            .ok_or_else(|| format!("`dropout` needs three values in `{s}`"))?
            .iter()
            .map(|x| float(x))
            .collect::<Res<_>>()?;
        g = g.with_dropout(GptDropout {
            embd: p[0],
            attn: p[1],
            resid: p[2],
        });
    }
    Ok(g)
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
) -> Res<(PathBuf, GptConfig, FullStateDict)> {
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
fn load_model_dir(dir: &Path) -> Res<(GptConfig, FullStateDict)> {
    let meta = crate::ckpt::peek(dir).map_err(e)?;
    let model = meta["fingerprint"]["model"]
        .as_str()
        .ok_or_else(|| format!("{}: no model in the checkpoint's metadata", dir.display()))?;
    let g = parse_model(model)?;
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

/// `train_gpt sample`: generates text from a checkpoint or Hugging Face GPT-2 weights.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "train_gpt sample",
    bin_name = "train_gpt sample",
    about = "Generates text from the newest complete checkpoint of --checkpoint-dir, or from Hugging Face GPT-2 weights (--init-from), with a KV cache, on the CPU or a GPU",
    max_term_width = 100
)]
pub struct SampleCli {
    /// Checkpoint root (train_gpt --checkpoint-dir): its newest complete checkpoint
    #[arg(long, value_name = "DIR", conflicts_with = "init_from")]
    pub checkpoint_dir: Option<PathBuf>,
    /// A Hugging Face GPT-2 model directory (model.safetensors + config.json) or its
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
    /// bytes or gpt2 (default: gpt2 when the model's vocab holds GPT-2's 50257 ids, else bytes)
    #[arg(long, value_name = "NAME", value_parser = ["bytes", "gpt2"])]
    pub tokenizer: Option<String>,
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
            let ck = crate::hf::HfCheckpoint::open(p).map_err(e)?;
            if let Some(note) = ck.note() {
                eprintln!("sample: {note}");
            }
            // Sampling drops nothing: the config's dropout is for training.
            let g = ck.config.gpt().with_dropout(GptDropout::default());
            (ck.path().display().to_string(), g, ck.full_state_dict())
        }
        _ => return Err("give --checkpoint-dir DIR or --init-from PATH".into()),
    };
    let tok = match cli.tokenizer.as_deref() {
        Some("gpt2") => Tokenizer::Gpt2,
        Some(_) => Tokenizer::Bytes,
        None if g.vocab >= Tokenizer::Gpt2.vocab() => Tokenizer::Gpt2,
        None => Tokenizer::Bytes,
    };
    if g.vocab < tok.vocab() {
        return Err(format!(
            "the model's vocab {} is smaller than the {tok:?} tokenizer's {}",
            g.vocab,
            tok.vocab()
        ));
    }
    let dev = sample_device(&cli.device)?;
    let model = model_from(&g, &full, &dev)?;
    let prompt = prompt_ids(tok, &cli.prompt)?;
    let o = SampleOpts {
        max_new_tokens: cli.max_new_tokens as usize,
        temperature: cli.temperature,
        top_k: cli.top_k.map(|k| k as usize),
        seed: cli.seed,
        max_id: tok.vocab(),
    };
    eprintln!(
        "sample: {source} (vocab {} d {} layers {}) on {}, {:?} tokenizer, {} prompt + {} new tokens, temperature {}, top-k {}, seed {}",
        g.vocab,
        g.d_model,
        g.n_layers,
        dev.id(),
        tok,
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
    generate_with(&model, &prompt, &o, &mut |t| {
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

    fn model(gelu: Gelu, tied: bool) -> Gpt {
        let dev = Device::cpu(0);
        let g = GptConfig::new(48, 32, 2, 4, 12)
            .with_gelu(gelu)
            .with_tied(tied);
        Gpt::new(&InitContext::eager(&dev, 5), &g).unwrap()
    }

    /// The KV-cache decoder's logits at every position equal the full forward's (within 1e-5
    /// of the row's largest |logit|), for both GELUs and tied/untied heads.
    #[test]
    fn cached_steps_match_the_full_forward() {
        for (gelu, tied) in [(Gelu::Exact, false), (Gelu::Tanh, true)] {
            let m = model(gelu, tied);
            let toks: Vec<u32> = vec![3, 17, 5, 40, 2, 2, 9, 33, 1, 0];
            let ids: Vec<i64> = toks.iter().map(|&t| t as i64).collect();
            let dev = m.tok_emb.weight.get().unwrap().device().clone();
            let x = Tensor::from_vec(ids, &[1, toks.len()], &dev).unwrap();
            let full = no_grad(|| m.forward(&x)).unwrap().to_vec::<f32>().unwrap();
            let mut dec = Decoder::new(&m).unwrap();
            for (t, &tok) in toks.iter().enumerate() {
                let step = dec.step(tok).unwrap();
                let row = &full[t * 48..(t + 1) * 48];
                let scale = row.iter().fold(0.0f32, |a, x| a.max(x.abs()));
                for (a, b) in step.iter().zip(row) {
                    assert!((a - b).abs() <= 1e-5 * scale, "pos {t}: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn sampling_is_deterministic_per_seed_and_greedy_at_zero() {
        let m = model(Gelu::Exact, false);
        let mut o = SampleOpts {
            max_new_tokens: 30, // more than seq_len 12: the context wraps
            temperature: 1.0,
            top_k: Some(10),
            seed: 7,
            max_id: 40,
        };
        let a = generate(&m, &[1, 2], &o).unwrap();
        assert_eq!(a, generate(&m, &[1, 2], &o).unwrap());
        assert_eq!(a.len(), 30);
        assert!(a.iter().all(|&t| t < 40));
        o.seed = 8;
        assert_ne!(a, generate(&m, &[1, 2], &o).unwrap());
        o.temperature = 0.0;
        let g = generate(&m, &[1, 2], &o).unwrap();
        let mut dec = Decoder::new(&m).unwrap();
        dec.step(1).unwrap();
        let l = dec.step(2).unwrap();
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

    #[test]
    fn fingerprint_models_parse() {
        let g = parse_model("vocab 256 d 64 layers 2 heads 4 seq 32 tied true gelu tanh").unwrap();
        let plain = GptConfig::new(256, 64, 2, 4, 32)
            .with_tied(true)
            .with_gelu(Gelu::Tanh);
        assert_eq!(g, plain);
        // A plain model's string is the old one (old checkpoints keep their fingerprint).
        assert_eq!(
            model_string(&plain),
            "vocab 256 d 64 layers 2 heads 4 seq 32 tied true gelu tanh"
        );
        let mut rich = plain
            .with_positions(64)
            .with_inner(100)
            .with_ln_eps(1e-3)
            .with_dropout(GptDropout {
                embd: 0.1,
                attn: 0.0,
                resid: 0.2,
            });
        rich.attn_scaling.by_head_dim = false;
        rich.attn_scaling.by_inverse_layer = true;
        assert_eq!(parse_model(&model_string(&rich)).unwrap(), rich);
        assert!(parse_model("vocab 256").is_err());
    }

    /// The decoder uses each layer's attention scale: with scale_attn_by_inverse_layer_idx its
    /// cached steps still equal the full forward.
    #[test]
    fn cached_steps_follow_the_attention_scale() {
        let dev = Device::cpu(0);
        let mut g = GptConfig::new(48, 32, 3, 4, 12);
        g.attn_scaling.by_inverse_layer = true;
        let m = Gpt::new(&InitContext::eager(&dev, 5), &g).unwrap();
        for (n, p) in fsdp_autograd::nn::named_parameters(&m) {
            if n.ends_with("qkv.weight") {
                no_grad(|| p.get().unwrap().scale_(30.0)).unwrap();
            }
        }
        let toks: Vec<u32> = vec![3, 17, 5, 40, 2, 9];
        let ids: Vec<i64> = toks.iter().map(|&t| t as i64).collect();
        let x = Tensor::from_vec(ids, &[1, toks.len()], &dev).unwrap();
        let full = no_grad(|| m.forward(&x)).unwrap().to_vec::<f32>().unwrap();
        let mut dec = Decoder::new(&m).unwrap();
        for (t, &tok) in toks.iter().enumerate() {
            let step = dec.step(tok).unwrap();
            let row = &full[t * 48..(t + 1) * 48];
            let scale = row.iter().fold(0.0f32, |a, x| a.max(x.abs()));
            for (a, b) in step.iter().zip(row) {
                assert!((a - b).abs() <= 1e-5 * scale, "pos {t}: {a} vs {b}");
            }
        }
    }

    /// `model_from` materializes every parameter on the device from the dict, and refuses a
    /// dict with a missing, misshapen or extra entry; `--device cuda` without a GPU (or built
    /// without CUDA) is one line naming what is missing.
    #[test]
    fn models_are_built_from_the_weights_on_the_device() {
        let m = model(Gelu::Exact, true);
        let full = FullStateDict::from_module(&m).unwrap();
        let g = m.config;
        let dev = m.tok_emb.weight.get().unwrap().device().clone();
        let back = model_from(&g, &full, &dev).unwrap();
        let x = Tensor::from_vec(vec![1i64, 2, 3], &[1, 3], &dev).unwrap();
        let a = no_grad(|| m.forward(&x)).unwrap().to_vec::<f32>().unwrap();
        let b = no_grad(|| back.forward(&x))
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        assert_eq!(a, b);
        let mut short = full.clone();
        short.entries.pop();
        assert!(model_from(&g, &short, &dev)
            .unwrap_err()
            .contains("no parameter"));
        let mut extra = full.clone();
        let mut e0 = extra.entries[0].clone();
        e0.name = "spare.weight".into();
        extra.entries.push(e0);
        assert!(model_from(&g, &extra, &dev)
            .unwrap_err()
            .contains("spare.weight"));
        if Device::cuda(0).is_err() {
            let err = sample_device("cuda").unwrap_err();
            assert!(
                err.starts_with("--device cuda: ") && !err.contains('\n'),
                "{err}"
            );
        }
    }
}
