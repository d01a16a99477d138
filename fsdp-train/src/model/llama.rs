//! The Llama family (`nn::Llama`, `--model llama-tiny|llama-small|llama-1b|llama-8b`):
//! [`Family`] for [`LlamaConfig`] and its KV-cache decoder ([`LlamaDecoder`]).
//!
//! The decoder runs a plain (unwrapped) [`Llama`] one token at a time: each layer's norms,
//! projections and MLP are the model's own modules on the one new position, RoPE is the model's
//! op at that position (`Tensor::rope` with `pos0`, whose two layouts coincide for one token),
//! and the attention of the position over the cached keys and values (grouped: query head `i`
//! reads key/value head `i / (heads / kv_heads)`, transformers' `repeat_kv`) is computed on the
//! host. When the context is full (`seq_len` tokens), the cache is rebuilt from the last
//! `seq_len / 2` tokens at positions from 0.

use std::path::Path;

use fsdp_alloc::Device;
use fsdp_autograd::nn::{Gelu, Llama, Llama3Scaling, LlamaConfig, Module};
use fsdp_autograd::{no_grad, AutogradError, InitContext, Tensor};
use fsdp_core::state_dict::FullStateDict;
use fsdp_core::wrap::WrapPolicy;
use fsdp_core::Fsdp;
use fsdp_plan::{ModelDesc, PlanError};

use super::family::{Decode, Family, Model, ShapeFlags};
use crate::hf::llama as hf;
use crate::hf::LlamaCheckpoint;

fn e(err: impl std::fmt::Display) -> String {
    err.to_string()
}

/// The fingerprint's model string of a Llama: `llama vocab V d D layers L heads H kv K ffn F
/// seq T tied B theta X eps E rope S` with `S` `default` or
/// `llama3:FACTOR:LOW:HIGH:ORIGINAL`.
fn fingerprint(c: &LlamaConfig) -> String {
    let rope = match c.rope_scaling {
        None => "default".to_string(),
        Some(s) => format!(
            "llama3:{}:{}:{}:{}",
            s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position
        ),
    };
    format!(
        "llama vocab {} d {} layers {} heads {} kv {} ffn {} seq {} tied {} theta {} eps {} rope {rope}",
        c.vocab,
        c.d_model,
        c.n_layers,
        c.n_heads,
        c.n_kv_heads,
        c.ffn_dim,
        c.seq_len,
        c.tied,
        c.rope_theta,
        c.rms_eps
    )
}

/// Parses [`fingerprint`]'s string.
///
/// # Errors
/// A missing or malformed field, naming it.
pub fn parse(s: &str) -> Result<LlamaConfig, String> {
    let w: Vec<&str> = s.split_whitespace().collect();
    let get = |k: &str| -> Result<&str, String> {
        w.iter()
            .position(|x| *x == k)
            .and_then(|i| w.get(i + 1).copied())
            .ok_or_else(|| format!("the checkpoint's model `{s}` has no `{k}`"))
    };
    let bad = |k: &str| format!("bad `{k}` in `{s}`");
    let num = |k: &str| -> Result<usize, String> { get(k)?.parse().map_err(|_| bad(k)) };
    let real = |k: &str| -> Result<f64, String> { get(k)?.parse().map_err(|_| bad(k)) };
    let scaling = match get("rope")? {
        "default" => None,
        r => {
            let p: Vec<&str> = r.strip_prefix("llama3:").unwrap_or("").split(':').collect();
            let f = |i: usize| -> Result<f64, String> {
                p.get(i)
                    .and_then(|x| x.parse().ok())
                    .ok_or_else(|| bad("rope"))
            };
            Some(Llama3Scaling {
                factor: f(0)?,
                low_freq_factor: f(1)?,
                high_freq_factor: f(2)?,
                original_max_position: f(3)? as usize,
            })
        }
    };
    Ok(LlamaConfig::new(
        num("vocab")?,
        num("d")?,
        num("layers")?,
        num("heads")?,
        num("kv")?,
        num("ffn")?,
        num("seq")?,
    )
    .with_tied(get("tied")? == "true")
    .with_rope_theta(real("theta")?)
    .with_rms_eps(real("eps")?)
    .with_rope_scaling(scaling))
}

/// A plain `Llama` of `c` on `dev` holding `full`'s values.
///
/// # Errors
/// A state dict that does not fit.
pub fn model_from(c: &LlamaConfig, full: &FullStateDict, dev: &Device) -> Result<Llama, String> {
    let model = Llama::new(&InitContext::eager(dev, 0), &c.with_checkpoint(false)).map_err(e)?;
    full.load_into_module(&model).map_err(e)?;
    Ok(model)
}

fn open(path: &Path) -> Result<LlamaCheckpoint, String> {
    LlamaCheckpoint::open(path).map_err(|e| format!("--init-from: {e}"))
}

impl Family for LlamaConfig {
    fn name(&self) -> &'static str {
        "llama"
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
        self.num_params()
    }
    fn unit_type(&self) -> &'static str {
        "LlamaDecoderLayer"
    }
    fn apply_flags(&mut self, f: &ShapeFlags) -> Result<(), String> {
        if f.gelu.is_some_and(|g| g != Gelu::Exact) {
            return Err("--gelu shapes a GPT's MLP; a Llama's is SwiGLU (SiLU·mul)".into());
        }
        if f.dropout.is_some() {
            return Err("--dropout is GPT-2's; a Llama model has no dropout".into());
        }
        if let Some(d) = f.d_model {
            self.d_model = d;
        }
        if let Some(l) = f.layers {
            self.n_layers = l;
        }
        if let Some(h) = f.heads {
            self.n_heads = h;
            // Multi-head unless --kv-heads says otherwise (a preset's grouping would rarely
            // divide another head count).
            self.n_kv_heads = h;
        }
        if let Some(k) = f.kv_heads {
            self.n_kv_heads = k;
        }
        if let Some(ff) = f.ffn_dim {
            self.ffn_dim = ff;
        }
        self.tied |= f.tied;
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
        if self.head_dim() % 2 != 0 {
            return Err(format!(
                "--d-model {} / --heads {} = {} is odd; RoPE needs an even head dim",
                self.d_model,
                self.n_heads,
                self.head_dim()
            ));
        }
        if self.n_heads % self.n_kv_heads != 0 {
            return Err(format!(
                "--heads {} is not a multiple of --kv-heads {}",
                self.n_heads, self.n_kv_heads
            ));
        }
        LlamaConfig::validate(self).map_err(e)
    }
    fn describe(&self) -> String {
        format!(
            "Llama vocab {} d_model {} layers {} heads {} kv heads {} ffn {} seq {} rope θ {}{}",
            self.vocab,
            self.d_model,
            self.n_layers,
            self.n_heads,
            self.n_kv_heads,
            self.ffn_dim,
            self.seq_len,
            self.rope_theta,
            if self.rope_scaling.is_some() {
                " (llama3 scaling)"
            } else {
                ""
            }
        )
    }
    fn fingerprint(&self) -> String {
        fingerprint(self)
    }
    fn build(&self, ctx: &InitContext) -> Result<Model, AutogradError> {
        Ok(Model::new(Box::new(Llama::new(ctx, self)?)))
    }
    fn plan_desc(&self, policy: &WrapPolicy) -> Result<ModelDesc, PlanError> {
        ModelDesc::llama(self, policy)
    }
    fn decoder(&self, full: &FullStateDict, dev: &Device) -> Result<Box<dyn Decode>, String> {
        Ok(Box::new(LlamaDecoder::new(model_from(self, full, dev)?)?))
    }
    fn hf_check(&self, path: &Path) -> Result<(), String> {
        hf::check_model(&open(path)?, self).map_err(e)
    }
    fn hf_load(&self, fsdp: &Fsdp<Model>, path: &Path) -> Result<(), String> {
        hf::load_into(fsdp, &open(path)?, self).map_err(e)
    }
    fn hf_export(
        &self,
        fsdp: &Fsdp<Model>,
        _source: Option<&Path>,
        dir: &Path,
    ) -> Result<(), String> {
        hf::export(fsdp, self, dir).map_err(|err| format!("--export-hf: {err}"))
    }
    fn hf_full(&self, path: &Path) -> Result<FullStateDict, String> {
        let ck = open(path)?;
        hf::check_model(&ck, self).map_err(e)?;
        Ok(ck.full_state_dict(self))
    }
}

/// Incremental decoding of a plain [`Llama`] with a KV cache (it owns the model).
pub struct LlamaDecoder {
    model: Llama,
    dev: Device,
    /// The rotary tables on the device.
    cos: Tensor,
    sin: Tensor,
    /// Per layer: keys (rotated) and values, `[t, kv_heads · head_dim]` each, row-major.
    cache: Vec<(Vec<f32>, Vec<f32>)>,
    /// The tokens in the cache.
    tokens: Vec<u32>,
}

impl LlamaDecoder {
    /// A decoder over `model` (its parameters must be materialized).
    ///
    /// # Errors
    /// A model whose parameters are not materialized.
    pub fn new(model: Llama) -> Result<LlamaDecoder, String> {
        let dev = model.embed_tokens.weight.get().map_err(e)?.device().clone();
        let (cos, sin) = model.rotary.on(&dev).map_err(e)?;
        let layers = model.config.n_layers;
        Ok(LlamaDecoder {
            model,
            dev,
            cos,
            sin,
            cache: vec![(Vec::new(), Vec::new()); layers],
            tokens: Vec::new(),
        })
    }

    fn forward_one(&mut self, token: u32) -> Result<Vec<f32>, String> {
        let c = self.model.config;
        let (h, kvh, dh) = (c.n_heads, c.n_kv_heads, c.head_dim());
        let (kvw, rep) = (kvh * dh, h / kvh);
        let pos = self.tokens.len();
        let m = &self.model;
        let ids = Tensor::from_vec(vec![token as i64], &[1, 1], &self.dev).map_err(e)?;
        let mut x = m.embed_tokens.call(&ids).map_err(e)?;
        let scale = 1.0 / (dh as f32).sqrt();
        let rope = |t: Tensor, heads: usize| -> Result<Vec<f32>, String> {
            t.reshape(&[1, 1, heads, dh])
                .and_then(|t| t.rope(&self.cos, &self.sin, pos))
                .and_then(|t| t.to_vec::<f32>())
                .map_err(e)
        };
        for (layer, (keys, values)) in m.layers.items().iter().zip(&mut self.cache) {
            let a = layer.self_attn();
            let hn = layer.input_layernorm().call(&x).map_err(e)?;
            let q = rope(a.q_proj.call(&hn).map_err(e)?, h)?;
            let k = rope(a.k_proj.call(&hn).map_err(e)?, kvh)?;
            let v = a
                .v_proj
                .call(&hn)
                .and_then(|t| t.to_vec::<f32>())
                .map_err(e)?;
            keys.extend_from_slice(&k);
            values.extend_from_slice(&v);
            let t = pos + 1;
            let mut y = vec![0.0f32; h * dh];
            let mut p = vec![0.0f32; t];
            for head in 0..h {
                let o = (head / rep) * dh;
                let qh = &q[head * dh..(head + 1) * dh];
                let mut max = f32::NEG_INFINITY;
                for (i, s) in p.iter_mut().enumerate() {
                    let k = &keys[i * kvw + o..i * kvw + o + dh];
                    *s = qh.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale;
                    max = max.max(*s);
                }
                let mut sum = 0.0f32;
                for s in p.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                let yh = &mut y[head * dh..(head + 1) * dh];
                for (i, s) in p.iter().enumerate() {
                    let v = &values[i * kvw + o..i * kvw + o + dh];
                    for (yy, vv) in yh.iter_mut().zip(v) {
                        *yy += s / sum * vv;
                    }
                }
            }
            let y = Tensor::from_vec(y, &[1, 1, h * dh], &self.dev).map_err(e)?;
            x = x.add(&a.o_proj.call(&y).map_err(e)?).map_err(e)?;
            let hn = layer.post_attention_layernorm().call(&x).map_err(e)?;
            x = x.add(&layer.mlp().call(&hn).map_err(e)?).map_err(e)?;
        }
        self.tokens.push(token);
        let x = m.norm.call(&x).map_err(e)?;
        m.lm_head
            .call(&x)
            .and_then(|t| t.to_vec::<f32>())
            .map_err(e)
    }
}

impl Decode for LlamaDecoder {
    fn step(&mut self, token: u32) -> Result<Vec<f32>, String> {
        let c = self.model.config;
        if token as usize >= c.vocab {
            return Err(format!(
                "token id {token} is outside the model's vocab {}",
                c.vocab
            ));
        }
        if self.tokens.len() == c.seq_len {
            let keep = self.tokens.split_off(c.seq_len - c.seq_len / 2);
            self.tokens.clear();
            for k in &mut self.cache {
                k.0.clear();
                k.1.clear();
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

    /// The KV-cache decoder's logits at every position equal the full forward's (within 1e-5 of
    /// the row's largest |logit|), grouped and tied, with Llama 3 scaling.
    #[test]
    fn cached_steps_match_the_full_forward() {
        let scaled = LlamaConfig::new(48, 32, 2, 4, 1, 40, 12)
            .with_tied(true)
            .with_rope_theta(5e5)
            .with_rope_scaling(Some(Llama3Scaling {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 4,
            }));
        for c in [LlamaConfig::new(48, 32, 2, 4, 2, 40, 12), scaled] {
            let dev = Device::cpu(0);
            let m = Llama::new(&InitContext::eager(&dev, 5), &c).unwrap();
            // Larger weights than the init so that attention matters.
            for p in fsdp_autograd::nn::parameters(&m) {
                let t = p.get().unwrap();
                no_grad(|| t.scale_(3.0)).unwrap();
            }
            let toks: Vec<u32> = vec![3, 17, 5, 40, 2, 2, 9, 33, 1, 0];
            let ids: Vec<i64> = toks.iter().map(|&t| t as i64).collect();
            let x = Tensor::from_vec(ids, &[1, toks.len()], &dev).unwrap();
            let full = no_grad(|| m.forward(&x)).unwrap().to_vec::<f32>().unwrap();
            let mut dec = LlamaDecoder::new(m).unwrap();
            for (t, &tok) in toks.iter().enumerate() {
                let step = dec.step(tok).unwrap();
                let row = &full[t * 48..(t + 1) * 48];
                let scale = row.iter().fold(0.0f32, |a, x| a.max(x.abs()));
                for (a, b) in step.iter().zip(row) {
                    assert!(
                        (a - b).abs() <= 1e-5 * scale,
                        "{c:?} pos {t}: {a} vs {b} (scale {scale})"
                    );
                }
            }
        }
    }

    /// The fixture saved by transformers (`make_llama_fixture.py`) continues a prompt greedily
    /// token for token as its `generate(do_sample=False)` did (`train_gpt sample --init-from
    /// DIR --temperature 0`'s path: the config, the full state dict, the KV-cache decoder).
    #[test]
    fn greedy_sampling_matches_transformers_generate() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama-tiny");
        let want: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
        let ids = |k: &str| -> Vec<u32> {
            want[k]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect()
        };
        let (spec, _) = super::super::ModelSpec::from_hf(&dir).unwrap();
        assert_eq!(spec.name(), "llama");
        let full = spec.hf_full(&dir).unwrap();
        let mut dec = spec.decoder(&full, &Device::cpu(0)).unwrap();
        let greedy = ids("greedy");
        let o = crate::sample::SampleOpts {
            max_new_tokens: greedy.len(),
            temperature: 0.0,
            top_k: None,
            seed: 0,
            max_id: spec.vocab(),
        };
        let got = crate::sample::generate(dec.as_mut(), &ids("prompt"), &o).unwrap();
        assert_eq!(got, greedy);
    }

    #[test]
    fn fingerprints_round_trip() {
        let c = LlamaConfig::new(128_256, 2048, 16, 32, 8, 8192, 2048)
            .with_tied(true)
            .with_rope_theta(500_000.0)
            .with_rms_eps(1e-5)
            .with_rope_scaling(Some(Llama3Scaling {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 8192,
            }));
        assert_eq!(parse(&fingerprint(&c)).unwrap(), c);
        let plain = LlamaConfig::tiny();
        assert_eq!(parse(&fingerprint(&plain)).unwrap(), plain);
        assert!(parse("llama vocab 3").is_err());
    }
}
