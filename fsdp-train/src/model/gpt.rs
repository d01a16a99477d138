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
use fsdp_autograd::nn::{Gelu, Gpt, GptConfig, GptDropout, Module};
use fsdp_autograd::{no_grad, AutogradError, InitContext, Tensor};
use fsdp_core::state_dict::FullStateDict;
use fsdp_core::wrap::WrapPolicy;
use fsdp_core::Fsdp;
use fsdp_plan::{ModelDesc, PlanError};

use super::family::{Decode, Family, Model, ShapeFlags};
use crate::hf::{self, HfCheckpoint, HfConfig};

/// The fingerprint's model string of a GPT: `vocab V d D layers L heads H seq T tied B gelu G`
/// (the format checkpoints have always carried), then only what differs from a plain
/// `GptConfig::new`: `positions N`, `inner N`, `ln-eps E`, `attn-scale-head-dim B`,
/// `attn-scale-inverse-layer B`, `dropout E A R` (so checkpoints of models without these
/// options keep their old fingerprint).
pub fn fingerprint(g: &GptConfig) -> String {
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
    let float = |x: &str| -> Result<f32, String> {
        x.parse().map_err(|_| format!("bad number `{x}` in `{s}`"))
    };
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
            .collect::<Result<_, String>>()?;
        g = g.with_dropout(GptDropout {
            embd: p[0],
            attn: p[1],
            resid: p[2],
        });
    }
    Ok(g)
}

/// Parameters of a GPT of this shape (token + position embeddings, blocks with their
/// feed-forward width `inner`, final norm, head).
pub fn params(c: &GptConfig) -> u64 {
    let (v, d, l, t, m) = (
        c.vocab as u64,
        c.d_model as u64,
        c.n_layers as u64,
        c.positions() as u64,
        c.inner() as u64,
    );
    let block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (m * d + m) + (m * d + d);
    let head = if c.tied { 0 } else { v * d };
    v * d + t * d + l * block + 2 * d + head
}

/// A plain `Gpt` of `g` on `dev` holding `full`'s values: built on the fake device (nothing
/// initialized), then each parameter materialized on `dev` from its entry.
///
/// # Errors
/// An entry missing, of another shape, or left over; device errors.
pub fn model_from(g: &GptConfig, full: &FullStateDict, dev: &Device) -> Result<Gpt, String> {
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
        self.gelu = f.gelu.unwrap_or(Gelu::Exact);
        if let Some(p) = f.dropout {
            *self = self.with_dropout(GptDropout::all(p));
        }
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
    fn build(&self, ctx: &InitContext) -> Result<Model, AutogradError> {
        Ok(Model::gpt(Gpt::new(ctx, self)?))
    }
    fn plan_desc(&self, policy: &WrapPolicy) -> Result<ModelDesc, PlanError> {
        ModelDesc::gpt(self, policy)
    }
    fn decoder(&self, full: &FullStateDict, dev: &Device) -> Result<Box<dyn Decode>, String> {
        Ok(Box::new(GptDecoder::new(model_from(self, full, dev)?)?))
    }
    fn hf_check(&self, path: &Path) -> Result<(), String> {
        let ck = HfCheckpoint::open(path).map_err(|e| format!("--init-from: {e}"))?;
        hf::check_model(&ck, self).map_err(e)
    }
    fn hf_load(&self, fsdp: &Fsdp<Model>, path: &Path) -> Result<(), String> {
        let ck = HfCheckpoint::open(path).map_err(|e| format!("--init-from: {e}"))?;
        hf::load_into(fsdp, &ck, self).map_err(|e| e.to_string())
    }
    fn hf_export(
        &self,
        fsdp: &Fsdp<Model>,
        source: Option<&Path>,
        dir: &Path,
    ) -> Result<(), String> {
        // The --init-from config's keys that do not change the model are carried into the export.
        let source = match source {
            Some(p) => Some(HfConfig::read_beside(p).map_err(|e| format!("--export-hf: {e}"))?),
            None => None,
        };
        hf::export(fsdp, self, source.as_ref(), dir).map_err(|e| format!("--export-hf: {e}"))
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
        for (i, (keys, values)) in self.cache.iter_mut().enumerate() {
            // The layer's own attention scale (`GptConfig::attn_scale`: by head dim and/or
            // inverse layer index, as the model's attention is scaled).
            let scale = g.attn_scale(i);
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
        // The context is the position table's length (`GptConfig::positions`).
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
        let plain = GptConfig::new(256, 64, 2, 4, 32)
            .with_tied(true)
            .with_gelu(Gelu::Tanh);
        assert_eq!(g, plain);
        // A plain model's string is the old one (old checkpoints keep their fingerprint).
        assert_eq!(
            fingerprint(&plain),
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
        assert_eq!(parse(&fingerprint(&rich)).unwrap(), rich);
        assert!(parse("vocab 256").is_err());
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

    /// `model_from` materializes every parameter on the device from the dict, and refuses a
    /// dict with a missing, misshapen or extra entry.
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
