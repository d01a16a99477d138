//! The main job and the ecosystem: `--tokenizer`, `--init-from`, `--export-hf`,
//! `--sample-every` (their flags, their resolution before training, and what a rank does with
//! them). The formats live in [`crate::tokenizer`], [`crate::hf`] and [`crate::sample`].

use std::path::PathBuf;

use clap::Args;
use fsdp_alloc::Device;
use fsdp_autograd::nn::GptDropout;
use fsdp_core::{state_dict, Fsdp};

use crate::data::DataFormat;
use crate::hf::HfCheckpoint;
use crate::job::{DataSpec, Interop, TrainConfig, MAX_STEPS};
use crate::model::{Model, ModelSpec};
use crate::sample::{self, SampleOpts};
use crate::tokenizer::{beside, parse_tokenizer, Tokenizer, TokenizerArg};

/// Tokenizer, Hugging Face weights and samples.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Ecosystem")]
pub struct InteropArgs {
    /// How text --data becomes tokens: bytes (vocab 256), gpt2 (GPT-2's BPE, vocab 50257, set
    /// automatically; a larger --vocab such as 50304 is allowed), or PATH/tokenizer.json (a
    /// Hugging Face tokenizer, e.g. Llama 3's; the vocab is raised to its ids). gpt2 caches the
    /// tokens next to the text as FILE.gpt2.bin (nanoGPT's u16 format), a tokenizer.json as
    /// FILE.tok-HASH.bin (u16, or FILE.tok-HASH.u32.bin past 65,536 ids), each with a verified
    /// header beside it, reused while the text and the tokenizer are unchanged. Default: the
    /// --init-from directory's tokenizer.json when there is one, else bytes
    #[arg(long, value_name = "bytes|gpt2|PATH", value_parser = parse_tokenizer)]
    pub tokenizer: Option<TokenizerArg>,
    /// Start from Hugging Face weights: a directory with model.safetensors (or the shards of
    /// model.safetensors.index.json) and config.json, of GPT2LMHeadModel or LlamaForCausalLM
    /// (F32, F16 or BF16), or its weights file. The model's shape comes from config.json (for
    /// GPT-2 also its GELU, layer-norm epsilon, attention scaling and dropout; --dropout replaces
    /// the dropout; a key train_gpt does not know is refused); --vocab may be larger, --seq-len
    /// shorter
    #[arg(long, value_name = "PATH")]
    pub init_from: Option<PathBuf>,
    /// After training, write the model as a Hugging Face directory (model.safetensors +
    /// config.json, loadable by GPT2LMHeadModel or LlamaForCausalLM.from_pretrained; a GPT-2
    /// export keeps the whole position table, the settings trained with, and --init-from's
    /// other config keys)
    #[arg(long, value_name = "DIR")]
    pub export_hf: Option<PathBuf>,
    /// Print a short sample (48 tokens, temperature 0.8, top-k 40, seed 0) every N steps
    #[arg(long, value_name = "N", default_value_t = 0,
          value_parser = clap::value_parser!(u64).range(0..=MAX_STEPS))]
    pub sample_every: u64,
}

impl InteropArgs {
    /// Checks the flags against the model (`explicit_vocab`/`explicit_seq`: `--vocab` /
    /// `--seq-len` as given) and sets a GPT-2 vocabulary when the tokenizer needs one.
    ///
    /// # Errors
    /// A usage message.
    pub fn resolve(
        &self,
        model: &mut ModelSpec,
        explicit_vocab: Option<u64>,
        explicit_seq: Option<u64>,
        shape_overridden: bool,
    ) -> Result<Interop, String> {
        let tokenizer = match (&self.tokenizer, self.init_from.as_deref().and_then(beside)) {
            (Some(t), _) => t.load()?,
            (None, Some(p)) => Tokenizer::json(&p)?,
            (None, None) => Tokenizer::Bytes,
        };
        if tokenizer != Tokenizer::Bytes {
            match explicit_vocab {
                Some(v) if (v as usize) < tokenizer.vocab() => {
                    return Err(format!(
                        "--tokenizer {} needs --vocab {} or more (got {v})",
                        tokenizer.name(),
                        tokenizer.vocab()
                    ))
                }
                Some(_) => {}
                None => {
                    let v = model.vocab().max(tokenizer.vocab());
                    model.set_vocab(v);
                }
            }
        }
        if self.init_from.is_some() && shape_overridden {
            return Err(
                "--init-from takes the model's shape from its config.json; drop --d-model, \
                 --layers, --heads, --kv-heads, --ffn-dim and --tied"
                    .into(),
            );
        }
        Ok(Interop {
            tokenizer,
            init_from: self.init_from.clone(),
            vocab: explicit_vocab.map(|v| v as usize),
            seq_len: explicit_seq.map(|t| t as usize),
            export_hf: self.export_hf.clone(),
            sample_every: self.sample_every as usize,
            gelu: None,
            dropout: None,
        })
    }
}

/// With `--init-from` and `--gelu`: refuses a `--gelu` that is not the model's
/// (`activation_function` of its config.json), either way round. `Err` is a usage message;
/// a model that cannot be opened is left to [`prepare`] to report.
pub fn check_gelu(c: &TrainConfig) -> Result<(), String> {
    let (Some(p), Some(want)) = (&c.interop.init_from, c.interop.gelu) else {
        return Ok(());
    };
    let Ok(ck) = HfCheckpoint::open(p) else {
        return Ok(());
    };
    let has = ck.config.gelu;
    if has != want {
        return Err(format!(
            "--gelu {} but the --init-from model {} uses the {} GELU (config.json); drop \
             --gelu (the model's own is used) or give --gelu {}",
            want.name(),
            ck.path().display(),
            has.name(),
            has.name()
        ));
    }
    Ok(())
}

/// Before training (exit 1 on error): with `--init-from`, opens and checks the checkpoint and
/// takes the model's shape from it; with `--tokenizer gpt2` or a `tokenizer.json` and text data,
/// tokenizes it into (or reuses) the cached `.bin` and trains on that. Returns the configuration to train with
/// and notes to print.
///
/// # Errors
/// One line naming the problem (for a file that is not GPT-2's, the first missing or
/// mismatched tensor).
pub fn prepare(c: TrainConfig) -> Result<(TrainConfig, Vec<String>), String> {
    let mut notes = Vec::new();
    let i = &c.interop;
    let model = match &i.init_from {
        None => c.model,
        Some(p) => {
            let (mut m, note) = ModelSpec::from_hf(p)?;
            m.set_checkpointed(c.model.checkpointed());
            let text = i.tokenizer != Tokenizer::Bytes || matches!(c.data, DataSpec::File { .. });
            let floor = if text { i.tokenizer.vocab() } else { 0 };
            let file_vocab = m.vocab();
            m.set_vocab(i.vocab.unwrap_or(file_vocab).max(file_vocab).max(floor));
            // Training at a shorter --seq-len uses the first rows; a GPT's table stays whole.
            if let Some(t) = i.seq_len {
                m.set_seq_len(t);
            }
            match (&mut m, i.dropout) {
                (ModelSpec::Gpt(g), Some(p)) => *g = g.with_dropout(GptDropout::all(p)),
                (ModelSpec::Llama(_), Some(_)) => {
                    return Err("--dropout: the --init-from model is a Llama, which has no \
                                dropout; drop --dropout"
                        .into())
                }
                _ => {}
            }
            m.hf_check(p)?;
            notes.push(format!("init-from: {note}"));
            if let ModelSpec::Gpt(g) = &m {
                let d = g.dropout;
                notes.push(format!(
                    "dropout in training: embeddings {}, attention probabilities {}, residual {} \
                     ({})",
                    d.embd,
                    d.attn,
                    d.resid,
                    if i.dropout.is_some() {
                        "--dropout"
                    } else {
                        "config.json"
                    }
                ));
            }
            m
        }
    };
    let data = match &c.data {
        DataSpec::File {
            path,
            format: DataFormat::Text,
            val_fraction,
        } if i.tokenizer != Tokenizer::Bytes => {
            let (bin, format, how) = crate::tokenizer::token_bin(path, &i.tokenizer, &mut |pid| {
                let who = pid.map_or("another process".into(), |p| format!("process {p}"));
                println!(
                    "tokenizer: waiting for {who}, which is writing the token cache of {}",
                    path.display()
                );
            })?;
            notes.push(format!(
                "tokenizer: {}; {how} {} (vocab {})",
                i.tokenizer.name(),
                bin.display(),
                i.tokenizer.vocab()
            ));
            DataSpec::File {
                path: bin,
                format,
                val_fraction: *val_fraction,
            }
        }
        other => other.clone(),
    };
    Ok((TrainConfig { model, data, ..c }, notes))
}

/// A rank's `--init-from`: loads its own pieces of the checkpoint.
///
/// # Errors
/// The checkpoint's problem, as one line.
pub fn init_rank(fsdp: &Fsdp<Model>, c: &TrainConfig) -> Result<bool, String> {
    let Some(p) = &c.interop.init_from else {
        return Ok(false);
    };
    c.model.hf_load(fsdp, p)?;
    Ok(true)
}

/// A rank's `--export-hf` after training (a collective).
///
/// # Errors
/// The checkpoint's problem, as one line.
pub fn export_rank(fsdp: &Fsdp<Model>, c: &TrainConfig) -> Result<Option<PathBuf>, String> {
    let Some(dir) = &c.interop.export_hf else {
        return Ok(None);
    };
    c.model
        .hf_export(fsdp, c.interop.init_from.as_deref(), dir)?;
    Ok(Some(dir.clone()))
}

/// `--sample-every`: at step `step`, every rank gathers the parameters to rank 0 (a collective)
/// and rank 0 returns a sample of 48 tokens.
///
/// # Errors
/// Gather or sampling errors as a line.
pub fn sample_rank(
    fsdp: &Fsdp<Model>,
    c: &TrainConfig,
    step: usize,
) -> Result<Option<String>, String> {
    let n = c.interop.sample_every;
    if n == 0 || step % n != 0 {
        return Ok(None);
    }
    let full = state_dict::full_state_dict(fsdp, true).map_err(|e| format!("sample: {e}"))?;
    if full.is_empty() {
        return Ok(None);
    }
    let tok = if matches!(c.data, DataSpec::Synthetic) {
        None
    } else {
        Some(&c.interop.tokenizer)
    };
    // On the CPU, whatever the training device; nothing is dropped (no dropout key is set).
    let mut dec = c.model.decoder(&full, &Device::cpu(0))?;
    let prompt = match tok {
        Some(t) => sample::prompt_ids(t, "")?,
        None => vec![3],
    };
    let o = SampleOpts {
        max_new_tokens: 48,
        temperature: 0.8,
        top_k: Some(40),
        seed: 0,
        max_id: tok.map_or(c.model.vocab(), |t| t.vocab().min(c.model.vocab())),
    };
    let out = sample::generate(dec.as_mut(), &prompt, &o)?;
    let text = match tok {
        Some(t) => format!("{:?}", t.decode(&out)?),
        None => format!("{out:?}"),
    };
    Ok(Some(format!("sample at step {step}: {text}")))
}
