//! The GPT family (`nn::Gpt`, `--model mini|small|gpt2`): [`Family`] for [`GptConfig`] and its
//! KV-cache decoder ([`GptDecoder`]).
//!
//! The decoder runs a plain (unwrapped) [`Gpt`] one token at a time. Each block's layer norms,
//! `qkv` and output projections and MLP are the model's own modules, called on the one new
//! position (so they run on the model's device with its kernels); the attention of that
//! position over all earlier ones is computed on the host from the cached keys and values of
//! every layer (`2 · layers · t · d` floats), so a step costs one position's forward instead of
//! the whole prefix's. When the context is full (`seq_len` tokens), the cache is rebuilt from the
//! last `seq_len / 2` tokens.

use std::path::Path;

use fsdp_alloc::Device;
use fsdp_autograd::nn::{Gelu, Gpt, GptConfig, Module};
use fsdp_autograd::{no_grad, AutogradError, InitContext, Tensor};
use fsdp_core::state_dict::FullStateDict;
use fsdp_core::wrap::WrapPolicy;
use fsdp_core::Fsdp;
use fsdp_plan::{ModelDesc, PlanError};

use super::family::{Decode, Family, Model, ShapeFlags};
use crate::hf::{self, HfCheckpoint};

/// The fingerprint's model string of a GPT (`vocab V d D layers L heads H seq T tied B gelu G`,
/// the format checkpoints have always carried).
fn fingerprint(g: &GptConfig) -> String {
    format!(
        "vocab {} d {} layers {} heads {} seq {} tied {} gelu {}",
        g.vocab,
        g.d_model,
        g.n_layers,
        g.n_heads,
        g.seq_len,
        g.tied,
        g.gelu.name()
    )
}

/// Parses [`fingerprint`]'s string.
///
/// # Errors
/// A missing or malformed field, naming it.
pub fn parse(s: &str) -> Result<GptConfig, String> {
    let w: Vec<&str> = s.split_whitespace().collect();
    let get = |k: &str| -> Result<&str, String> {
        w.iter()
            .position(|x| *x == k)
            .and_then(|i| w.get(i + 1).copied())
            .ok_or_else(|| format!("the checkpoint's model `{s}` has no `{k}`"))
    };
    let num = |k: &str| -> Result<usize, String> {
        get(k)?.parse().map_err(|_| format!("bad `{k}` in `{s}`"))
    };
    let gelu: Gelu = get("gelu")?.parse()?;
    Ok(GptConfig::new(
        num("vocab")?,
        num("d")?,
        num("layers")?,
        num("heads")?,
        num("seq")?,
    )
    .with_tied(get("tied")? == "true")
    .with_gelu(gelu))
}

/// Parameters of a GPT of this shape (token + position embeddings, blocks, final norm, head).
pub fn params(c: &GptConfig) -> u64 {
    let (v, d, l, t) = (
        c.vocab as u64,
        c.d_model as u64,
        c.n_layers as u64,
        c.seq_len as u64,
    );
    let block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d);
    let head = if c.tied { 0 } else { v * d };
    v * d + t * d + l * block + 2 * d + head
}

/// A plain CPU `Gpt` of `g` holding `full`'s values.
///
/// # Errors
/// A state dict that does not fit.
pub fn model_from(g: &GptConfig, full: &FullStateDict) -> Result<Gpt, String> {
    let dev = Device::cpu(0);
    let model = Gpt::new(&InitContext::eager(&dev, 0), &g.with_checkpoint(false)).map_err(e)?;
    full.load_into_module(&model).map_err(e)?;
    Ok(model)
}

impl Family for GptConfig {
    fn name(&self) -> &'static str {
        "gpt"
    }
    fn vocab(&self) -> usize {
        self.vocab
    }
    fn set_vocab(&mut self, vocab: usize) {
        self.vocab = vocab;
    }
    fn seq_len(&self) -> usize {
        self.seq_len
    }
    fn set_seq_len(&mut self, seq_len: usize) {
        self.seq_len = seq_len;
    }
    fn d_model(&self) -> usize {
        self.d_model
    }
    fn n_layers(&self) -> usize {
        self.n_layers
    }
    fn tied(&self) -> bool {
        self.tied
    }
    fn checkpointed(&self) -> bool {
        self.checkpoint
    }
    fn set_checkpointed(&mut self, on: bool) {
        self.checkpoint = on;
    }
    fn params(&self) -> u64 {
        params(self)
    }
    fn unit_type(&self) -> &'static str {
        "Block"
    }
    fn apply_flags(&mut self, f: &ShapeFlags) -> Result<(), String> {
        if f.kv_heads.is_some() || f.ffn_dim.is_some() {
            return Err(
                "--kv-heads and --ffn-dim shape a Llama model; a GPT has as many key/value heads \
                 as heads and a 4·d feed-forward"
                    .into(),
            );
        }
        if let Some(d) = f.d_model {
            self.d_model = d;
        }
        if let Some(l) = f.layers {
            self.n_layers = l;
        }
        if let Some(h) = f.heads {
            self.n_heads = h;
        }
        self.tied |= f.tied;
        self.gelu = f.gelu;
        self.checkpoint |= f.checkpoint;
        Ok(())
    }
    fn validate(&self) -> Result<(), String> {
        if self.d_model % self.n_heads != 0 {
            return Err(format!(
                "--d-model {} is not divisible by --heads {}",
                self.d_model, self.n_heads
            ));
        }
        Ok(())
    }
    fn describe(&self) -> String {
        format!(
            "GPT vocab {} d_model {} layers {} heads {} seq {} gelu {}",
            self.vocab,
            self.d_model,
            self.n_layers,
            self.n_heads,
            self.seq_len,
            self.gelu.name()
        )
    }
    fn fingerprint(&self) -> String {
        fingerprint(self)
    }
    fn build(&self, ctx: &InitContext) -> Result<Box<dyn Module>, AutogradError> {
        Ok(Box::new(Gpt::new(ctx, self)?))
    }
    fn plan_desc(&self, policy: &WrapPolicy) -> Result<ModelDesc, PlanError> {
        ModelDesc::gpt(self, policy)
    }
    fn decoder(&self, full: &FullStateDict) -> Result<Box<dyn Decode>, String> {
        Ok(Box::new(GptDecoder::new(model_from(self, full)?)?))
    }
    fn hf_check(&self, path: &Path) -> Result<(), String> {
        let ck = HfCheckpoint::open(path).map_err(|e| format!("--init-from: {e}"))?;
        hf::check_model(&ck, self).map_err(e)
    }
    fn hf_load(&self, fsdp: &Fsdp<Model>, path: &Path) -> Result<(), String> {
        let ck = HfCheckpoint::open(path).map_err(|e| format!("--init-from: {e}"))?;
        hf::load_into(fsdp, &ck, self).map_err(|e| e.to_string())
    }
    fn hf_export(&self, fsdp: &Fsdp<Model>, dir: &Path) -> Result<(), String> {
        hf::export(fsdp, self, dir).map_err(|e| format!("--export-hf: {e}"))
    }
    fn hf_full(&self, path: &Path) -> Result<FullStateDict, String> {
        let ck = HfCheckpoint::open(path).map_err(e)?;
        Ok(ck.full_state_dict())
    }
}

/// The named child of `m`.
pub(crate) fn child<'a>(m: &'a dyn Module, name: &str) -> Result<&'a dyn Module, String> {
    let mut found = None;
    m.visit_children(&mut |n, c| {
        if n == name {
            found = Some(c);
        }
    });
    found.ok_or_else(|| format!("{} has no child `{name}`", m.type_name()))
}

pub(crate) fn e(err: impl std::fmt::Display) -> String {
    err.to_string()
}

/// Incremental decoding of a plain [`Gpt`] with a KV cache (it owns the model).
pub struct GptDecoder {
    model: Gpt,
    dev: Device,
    /// Per layer: keys and values, `[t, d]` each, row-major.
    cache: Vec<(Vec<f32>, Vec<f32>)>,
    /// The tokens in the cache.
    tokens: Vec<u32>,
}

impl GptDecoder {
    /// A decoder over `model` (its parameters must be materialized).
    ///
    /// # Errors
    /// A model whose parameters are not materialized.
    pub fn new(model: Gpt) -> Result<GptDecoder, String> {
        let dev = model.tok_emb.weight.get().map_err(e)?.device().clone();
        let layers = model.config.n_layers;
        Ok(GptDecoder {
            model,
            dev,
            cache: vec![(Vec::new(), Vec::new()); layers],
            tokens: Vec::new(),
        })
    }

    fn forward_one(&mut self, token: u32) -> Result<Vec<f32>, String> {
        let g = self.model.config;
        let (d, h) = (g.d_model, g.n_heads);
        let dh = d / h;
        let pos = self.tokens.len();
        let ids = Tensor::from_vec(vec![token as i64], &[1, 1], &self.dev).map_err(e)?;
        let at = Tensor::from_vec(vec![pos as i64], &[1], &self.dev).map_err(e)?;
        let m = &self.model;
        let mut x = m
            .tok_emb
            .call(&ids)
            .and_then(|t| t.add(&m.pos_emb.call(&at)?))
            .map_err(e)?;
        let scale = 1.0 / (dh as f32).sqrt();
        for (i, (keys, values)) in self.cache.iter_mut().enumerate() {
            let b = child(&m.blocks, &i.to_string())?;
            let attn = child(b, "attn")?;
            let qkv = child(attn, "qkv")?
                .call(&child(b, "ln1")?.call(&x).map_err(e)?)
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
            x = x
                .add(&child(attn, "proj")?.call(&y).map_err(e)?)
                .map_err(e)?;
            let mlp = child(b, "mlp")?
                .call(&child(b, "ln2")?.call(&x).map_err(e)?)
                .map_err(e)?;
            x = x.add(&mlp).map_err(e)?;
        }
        self.tokens.push(token);
        let x = m.ln_f.call(&x).map_err(e)?;
        m.head.call(&x).and_then(|t| t.to_vec::<f32>()).map_err(e)
    }
}

impl Decode for GptDecoder {
    fn step(&mut self, token: u32) -> Result<Vec<f32>, String> {
        let g = self.model.config;
        if token as usize >= g.vocab {
            return Err(format!(
                "token id {token} is outside the model's vocab {}",
                g.vocab
            ));
        }
        if self.tokens.len() == g.seq_len {
            let keep = self.tokens.split_off(g.seq_len - g.seq_len / 2);
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
            let mut dec = GptDecoder::new(m).unwrap();
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
    fn fingerprint_models_parse() {
        let g = parse("vocab 256 d 64 layers 2 heads 4 seq 32 tied true gelu tanh").unwrap();
        let want = GptConfig::new(256, 64, 2, 4, 32)
            .with_tied(true)
            .with_gelu(Gelu::Tanh);
        assert_eq!(g, want);
        assert_eq!(parse(&fingerprint(&want)).unwrap(), want);
        assert!(parse("vocab 256").is_err());
    }

    #[test]
    fn parameter_counts() {
        let g = GptConfig::new(50_257, 768, 12, 12, 1024).with_tied(true);
        assert_eq!(params(&g), 124_439_808);
        let dev = Device::cpu(0);
        let small = GptConfig::new(64, 32, 2, 4, 16);
        let m = Gpt::new(&InitContext::eager(&dev, 0), &small).unwrap();
        let n: usize = fsdp_autograd::nn::parameters(&m)
            .iter()
            .map(|p| p.numel())
            .sum();
        assert_eq!(params(&small), n as u64);
    }
}
