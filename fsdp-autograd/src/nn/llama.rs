//! A Llama (transformers' `LlamaForCausalLM`): a token embedding, decoder layers of RMSNorm →
//! grouped-query self-attention with rotary position embeddings → residual, RMSNorm → SwiGLU MLP
//! → residual, a final RMSNorm and an LM head (untied by default, optionally tied to the
//! embedding); no biases.
//!
//! Module names follow transformers' (without its `model.` prefix), so a Hugging Face state dict
//! maps one to one: `embed_tokens`, `layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj,
//! post_attention_layernorm, mlp.{gate,up,down}_proj}`, `norm`, `lm_head`. One decoder layer
//! (`LlamaDecoderLayer`) is the natural FSDP unit; each may be activation-checkpointed.
//!
//! Init as transformers': every linear and the embedding Normal(0, 0.02), the norms ones.
//! Rotary tables ([`RotaryTables`]) are computed on the host as transformers computes them
//! (inverse frequencies in f32, Llama 3's `llama3` scaling when configured) and uploaded once
//! per device on first use.

use std::sync::{Arc, Mutex};

use fsdp_alloc::{DType, Device, DeviceId};

use crate::autograd::checkpoint;
use crate::error::{shape_err, AutogradError, Result};
use crate::init::InitOp;
use crate::nn::{Embedding, Linear, Module, ModuleHooks, RmsNorm};
use crate::ops;
use crate::param::{InitContext, Parameter};
use crate::tensor::Tensor;

/// Std of transformers' `initializer_range` default.
const STD: f32 = 0.02;

fn normal() -> Vec<InitOp> {
    vec![InitOp::Normal {
        mean: 0.0,
        std: STD,
    }]
}

/// A bias-free `f32` layer `name` of `d_in → d_out`, Normal(0, 0.02).
fn linear(ctx: &InitContext, name: &str, d_in: usize, d_out: usize) -> Result<Linear> {
    Linear::with_init(
        &ctx.child(name),
        d_in,
        d_out,
        false,
        DType::F32,
        normal(),
        vec![],
    )
}

/// Llama 3's rotary scaling (transformers' `rope_type = "llama3"`): low frequencies divided by
/// `factor`, high ones kept, the band between interpolated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Scaling {
    /// `factor` (8 for Llama 3.1, 32 for Llama 3.2).
    pub factor: f64,
    /// `low_freq_factor` (1).
    pub low_freq_factor: f64,
    /// `high_freq_factor` (4).
    pub high_freq_factor: f64,
    /// `original_max_position_embeddings` (8192).
    pub original_max_position: usize,
}

/// Hyper-parameters of a [`Llama`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlamaConfig {
    /// Vocabulary size (`vocab_size`).
    pub vocab: usize,
    /// Model width (`hidden_size`), divisible by `n_heads`.
    pub d_model: usize,
    /// Decoder layers (`num_hidden_layers`).
    pub n_layers: usize,
    /// Query heads (`num_attention_heads`); the head dim `d_model / n_heads` must be even.
    pub n_heads: usize,
    /// Key/value heads (`num_key_value_heads`), dividing `n_heads` (grouped-query attention).
    pub n_kv_heads: usize,
    /// Feed-forward width (`intermediate_size`).
    pub ffn_dim: usize,
    /// Longest sequence (the rotary tables' positions).
    pub seq_len: usize,
    /// Rotary base θ (`rope_theta`).
    pub rope_theta: f64,
    /// Llama 3's rotary scaling, if any (`rope_scaling` / `rope_parameters` of type `llama3`).
    pub rope_scaling: Option<Llama3Scaling>,
    /// RMSNorm epsilon (`rms_norm_eps`).
    pub rms_eps: f64,
    /// Tie the LM head to the token embedding (`tie_word_embeddings`).
    pub tied: bool,
    /// Activation checkpointing of every decoder layer.
    pub checkpoint: bool,
}

impl LlamaConfig {
    /// A configuration with θ = 10,000, eps 1e-5, no rotary scaling, untied, no checkpointing.
    pub fn new(
        vocab: usize,
        d_model: usize,
        n_layers: usize,
        n_heads: usize,
        n_kv_heads: usize,
        ffn_dim: usize,
        seq_len: usize,
    ) -> LlamaConfig {
        LlamaConfig {
            vocab,
            d_model,
            n_layers,
            n_heads,
            n_kv_heads,
            ffn_dim,
            seq_len,
            rope_theta: 10_000.0,
            rope_scaling: None,
            rms_eps: 1e-5,
            tied: false,
            checkpoint: false,
        }
    }

    /// A tiny model for tests: vocab 32, d 32, 2 layers, 4 heads, 2 key/value heads, ffn 64,
    /// seq 16.
    pub fn tiny() -> LlamaConfig {
        LlamaConfig::new(32, 32, 2, 4, 2, 64, 16)
    }

    /// With `tied` set.
    pub fn with_tied(mut self, tied: bool) -> LlamaConfig {
        self.tied = tied;
        self
    }

    /// With `checkpoint` set.
    pub fn with_checkpoint(mut self, checkpoint: bool) -> LlamaConfig {
        self.checkpoint = checkpoint;
        self
    }

    /// With rotary base `theta`.
    pub fn with_rope_theta(mut self, theta: f64) -> LlamaConfig {
        self.rope_theta = theta;
        self
    }

    /// With Llama 3's rotary scaling.
    pub fn with_rope_scaling(mut self, scaling: Option<Llama3Scaling>) -> LlamaConfig {
        self.rope_scaling = scaling;
        self
    }

    /// With RMSNorm epsilon `eps`.
    pub fn with_rms_eps(mut self, eps: f64) -> LlamaConfig {
        self.rms_eps = eps;
        self
    }

    /// Values per head: `d_model / n_heads`.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads.max(1)
    }

    /// Parameters of the model (no padding; a tied head counted once).
    pub fn num_params(&self) -> u64 {
        let (v, d, l, f) = (
            self.vocab as u64,
            self.d_model as u64,
            self.n_layers as u64,
            self.ffn_dim as u64,
        );
        let kv = (self.n_kv_heads * self.head_dim()) as u64;
        let layer = 2 * d + (d * d + 2 * d * kv + d * d) + 3 * d * f;
        let head = if self.tied { 0 } else { v * d };
        v * d + l * layer + d + head
    }

    /// Checks the sizes and the rotary parameters.
    ///
    /// # Errors
    /// [`AutogradError::Argument`] naming what is inconsistent.
    pub fn validate(&self) -> Result<()> {
        let bad = |detail: String| {
            Err(AutogradError::Argument {
                op: "LlamaConfig",
                detail,
            })
        };
        let sizes = [
            self.vocab,
            self.d_model,
            self.n_layers,
            self.n_heads,
            self.n_kv_heads,
            self.ffn_dim,
            self.seq_len,
        ];
        if sizes.contains(&0) {
            return bad(format!("{self:?}: sizes must be positive"));
        }
        if self.d_model % self.n_heads != 0 {
            return bad(format!(
                "d_model {} is not divisible by n_heads {}",
                self.d_model, self.n_heads
            ));
        }
        if self.head_dim() % 2 != 0 {
            return bad(format!(
                "the head dim d_model / n_heads = {} must be even (RoPE rotates pairs)",
                self.head_dim()
            ));
        }
        if self.n_heads % self.n_kv_heads != 0 {
            return bad(format!(
                "n_heads {} is not a multiple of n_kv_heads {}",
                self.n_heads, self.n_kv_heads
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return bad(format!("rope_theta {} must be above 1", self.rope_theta));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps >= 0.0) {
            return bad(format!("rms_eps {} must be finite and >= 0", self.rms_eps));
        }
        if let Some(s) = self.rope_scaling {
            let ok = s.factor.is_finite()
                && s.factor > 0.0
                && s.low_freq_factor > 0.0
                && s.high_freq_factor > s.low_freq_factor
                && s.original_max_position > 0;
            if !ok {
                return bad(format!(
                    "{s:?}: llama3 rope scaling needs factor > 0, 0 < low_freq_factor < \
                     high_freq_factor and original_max_position > 0"
                ));
            }
        }
        Ok(())
    }
}

/// The inverse frequencies `θ_j` of a head of `head_dim` values, as transformers computes them
/// in `float32`: `1 / base^(2j / head_dim)` (the exponent and the power in f32), then Llama 3's
/// scaling when given (`_compute_llama3_parameters`, every step in f32 as torch evaluates it).
pub fn rope_inv_freq(head_dim: usize, theta: f64, scaling: Option<Llama3Scaling>) -> Vec<f32> {
    let base = theta as f32;
    let dim = head_dim as f32;
    let inv: Vec<f32> = (0..head_dim / 2)
        .map(|j| 1.0f32 / base.powf((2 * j) as f32 / dim))
        .collect();
    let Some(s) = scaling else {
        return inv;
    };
    let factor = s.factor as f32;
    let low = s.low_freq_factor as f32;
    let old = s.original_max_position as f32;
    let low_wavelen = (s.original_max_position as f64 / s.low_freq_factor) as f32;
    let high_wavelen = (s.original_max_position as f64 / s.high_freq_factor) as f32;
    let span = (s.high_freq_factor - s.low_freq_factor) as f32;
    let two_pi = (2.0 * std::f64::consts::PI) as f32;
    inv.into_iter()
        .map(|f| {
            let wavelen = two_pi / f;
            let scaled = if wavelen > low_wavelen { f / factor } else { f };
            let smooth = (old / wavelen - low) / span;
            let smoothed = (1.0 - smooth) * scaled / factor + smooth * scaled;
            // transformers: ~(wavelen < high) * ~(wavelen > low); the same for the (finite)
            // wavelengths here.
            let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
            if medium {
                smoothed
            } else {
                scaled
            }
        })
        .collect()
}

/// The rotary tables of a [`LlamaConfig`]: `cos` and `sin` of `[seq_len, head_dim / 2]` (row `p`:
/// the angles `p · θ_j`, the product in f32 as transformers forms it, the cosine and sine
/// rounded once from f64), on the host, and uploaded once per device
/// ([`RotaryTables::on`]).
#[derive(Debug)]
pub struct RotaryTables {
    rows: usize,
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
    uploaded: Mutex<Vec<(DeviceId, Tensor, Tensor)>>,
}

impl RotaryTables {
    /// The tables of `c` (`c.seq_len` positions).
    pub fn new(c: &LlamaConfig) -> RotaryTables {
        let inv = rope_inv_freq(c.head_dim(), c.rope_theta, c.rope_scaling);
        let half = inv.len();
        let (mut cos, mut sin) = (
            Vec::with_capacity(c.seq_len * half),
            Vec::with_capacity(c.seq_len * half),
        );
        for p in 0..c.seq_len {
            for &f in &inv {
                let angle = (p as f32 * f) as f64;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        RotaryTables {
            rows: c.seq_len,
            half,
            cos,
            sin,
            uploaded: Mutex::new(Vec::new()),
        }
    }

    /// Positions the tables hold.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The host tables: `(cos, sin)`, each `[rows, head_dim / 2]` row-major.
    pub fn host(&self) -> (&[f32], &[f32]) {
        (&self.cos, &self.sin)
    }

    /// The tables as `f32` tensors on `device` (uploaded at the first call per device, on the
    /// calling thread's current stream, then reused).
    ///
    /// # Errors
    /// The upload's.
    pub fn on(&self, device: &Device) -> Result<(Tensor, Tensor)> {
        let mut up = self.uploaded.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, c, s)) = up.iter().find(|(d, _, _)| *d == device.id()) {
            return Ok((c.clone(), s.clone()));
        }
        let shape = [self.rows, self.half];
        let c = Tensor::from_slice(&self.cos, &shape, device)?;
        let s = Tensor::from_slice(&self.sin, &shape, device)?;
        up.push((device.id(), c.clone(), s.clone()));
        Ok((c, s))
    }
}

/// Grouped-query causal self-attention with rotary embeddings: `q_proj` (`n_heads` heads),
/// `k_proj` and `v_proj` (`n_kv_heads` heads), `o_proj`, no biases.
#[derive(Debug)]
pub struct LlamaAttention {
    /// `[n_heads · head_dim, d]`.
    pub q_proj: Linear,
    /// `[n_kv_heads · head_dim, d]`.
    pub k_proj: Linear,
    /// `[n_kv_heads · head_dim, d]`.
    pub v_proj: Linear,
    /// `[d, n_heads · head_dim]`.
    pub o_proj: Linear,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// The model's rotary tables.
    pub rotary: Arc<RotaryTables>,
    hooks: ModuleHooks,
}

impl LlamaAttention {
    /// transformers' init (Normal(0, 0.02)).
    pub fn new(ctx: &InitContext, c: &LlamaConfig, rotary: Arc<RotaryTables>) -> Result<Self> {
        let (d, hd) = (c.d_model, c.head_dim());
        Ok(LlamaAttention {
            q_proj: linear(ctx, "q_proj", d, c.n_heads * hd)?,
            k_proj: linear(ctx, "k_proj", d, c.n_kv_heads * hd)?,
            v_proj: linear(ctx, "v_proj", d, c.n_kv_heads * hd)?,
            o_proj: linear(ctx, "o_proj", c.n_heads * hd, d)?,
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            rotary,
            hooks: ModuleHooks::new(),
        })
    }
}

impl Module for LlamaAttention {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let &[b, t, _] = x.shape() else {
            return Err(shape_err(
                "LlamaAttention",
                format!("input must be [batch, t, d], got {:?}", x.shape()),
            ));
        };
        let (h, kvh) = (self.n_heads, self.n_kv_heads);
        let dh = self.q_proj.weight.shape()[0] / h;
        let (cos, sin) = self.rotary.on(x.device())?;
        // RoPE reads the projections' [b, t, heads, dh] and writes [b, heads, t, dh].
        let q = self.q_proj.call(x)?.reshape(&[b, t, h, dh])?;
        let q = ops::rope(&q, &cos, &sin, 0)?;
        let k = self.k_proj.call(x)?.reshape(&[b, t, kvh, dh])?;
        let k = ops::rope(&k, &cos, &sin, 0)?;
        let v = self.v_proj.call(x)?.reshape(&[b, t, kvh, dh])?;
        let v = v.transpose(1, 2)?;
        // Grouped-query attention in the kernel: query head i reads key/value head
        // i / (h / kvh) in place (no repeated K/V).
        let y = ops::causal_attention(&q, &k, &v)?; // [b, h, t, dh]
        let y = y.transpose(1, 2)?.reshape(&[b, t, h * dh])?;
        self.o_proj.call(&y)
    }
    fn visit_params(&self, _f: &mut dyn FnMut(&str, &Parameter)) {}
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(&str, &'a dyn Module)) {
        f("q_proj", &self.q_proj);
        f("k_proj", &self.k_proj);
        f("v_proj", &self.v_proj);
        f("o_proj", &self.o_proj);
    }
    fn type_name(&self) -> &'static str {
        "LlamaAttention"
    }
    fn hooks(&self) -> &ModuleHooks {
        &self.hooks
    }
}

/// The SwiGLU feed-forward: `down_proj(silu(gate_proj(x)) · up_proj(x))`, the gate and product
/// one fused op ([`ops::silu_mul`]).
#[derive(Debug)]
pub struct LlamaMlp {
    /// `[ffn, d]`.
    pub gate_proj: Linear,
    /// `[ffn, d]`.
    pub up_proj: Linear,
    /// `[d, ffn]`.
    pub down_proj: Linear,
    hooks: ModuleHooks,
}

impl LlamaMlp {
    /// transformers' init (Normal(0, 0.02)).
    pub fn new(ctx: &InitContext, d: usize, ffn: usize) -> Result<LlamaMlp> {
        Ok(LlamaMlp {
            gate_proj: linear(ctx, "gate_proj", d, ffn)?,
            up_proj: linear(ctx, "up_proj", d, ffn)?,
            down_proj: linear(ctx, "down_proj", ffn, d)?,
            hooks: ModuleHooks::new(),
        })
    }
}

impl Module for LlamaMlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let g = self.gate_proj.call(x)?;
        let u = self.up_proj.call(x)?;
        self.down_proj.call(&ops::silu_mul(&g, &u)?)
    }
    fn visit_params(&self, _f: &mut dyn FnMut(&str, &Parameter)) {}
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(&str, &'a dyn Module)) {
        f("gate_proj", &self.gate_proj);
        f("up_proj", &self.up_proj);
        f("down_proj", &self.down_proj);
    }
    fn type_name(&self) -> &'static str {
        "LlamaMlp"
    }
    fn hooks(&self) -> &ModuleHooks {
        &self.hooks
    }
}

/// The layers of a decoder layer (shared with the checkpoint closure).
#[derive(Debug)]
struct LayerParts {
    input_layernorm: RmsNorm,
    self_attn: LlamaAttention,
    post_attention_layernorm: RmsNorm,
    mlp: LlamaMlp,
}

impl LayerParts {
    fn run(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.add(&self.self_attn.call(&self.input_layernorm.call(x)?)?)?;
        x.add(&self.mlp.call(&self.post_attention_layernorm.call(&x)?)?)
    }
}

/// A decoder layer: `x + attn(norm(x))`, then `x + mlp(norm(x))`; optionally
/// activation-checkpointed (recomputed in backward). The FSDP unit of a [`Llama`].
#[derive(Debug)]
pub struct LlamaDecoderLayer {
    parts: Arc<LayerParts>,
    checkpoint: bool,
    hooks: ModuleHooks,
}

impl LlamaDecoderLayer {
    /// A layer of `c` over the model's rotary tables.
    pub fn new(
        ctx: &InitContext,
        c: &LlamaConfig,
        rotary: Arc<RotaryTables>,
    ) -> Result<LlamaDecoderLayer> {
        let eps = c.rms_eps as f32;
        Ok(LlamaDecoderLayer {
            parts: Arc::new(LayerParts {
                input_layernorm: RmsNorm::new(&ctx.child("input_layernorm"), c.d_model, eps)?,
                self_attn: LlamaAttention::new(&ctx.child("self_attn"), c, rotary)?,
                post_attention_layernorm: RmsNorm::new(
                    &ctx.child("post_attention_layernorm"),
                    c.d_model,
                    eps,
                )?,
                mlp: LlamaMlp::new(&ctx.child("mlp"), c.d_model, c.ffn_dim)?,
            }),
            checkpoint: c.checkpoint,
            hooks: ModuleHooks::new(),
        })
    }

    /// True if the layer is activation-checkpointed.
    pub fn is_checkpointed(&self) -> bool {
        self.checkpoint
    }

    /// The attention.
    pub fn self_attn(&self) -> &LlamaAttention {
        &self.parts.self_attn
    }

    /// The norm before the attention.
    pub fn input_layernorm(&self) -> &RmsNorm {
        &self.parts.input_layernorm
    }

    /// The norm before the MLP.
    pub fn post_attention_layernorm(&self) -> &RmsNorm {
        &self.parts.post_attention_layernorm
    }

    /// The MLP.
    pub fn mlp(&self) -> &LlamaMlp {
        &self.parts.mlp
    }
}

impl Module for LlamaDecoderLayer {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.checkpoint {
            let parts = Arc::clone(&self.parts);
            let mut out = checkpoint(
                move |xs: &[Tensor]| Ok(vec![parts.run(&xs[0])?]),
                std::slice::from_ref(x),
            )?;
            Ok(out.pop().expect("one output"))
        } else {
            self.parts.run(x)
        }
    }
    fn visit_params(&self, _f: &mut dyn FnMut(&str, &Parameter)) {}
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(&str, &'a dyn Module)) {
        f("input_layernorm", &self.parts.input_layernorm);
        f("self_attn", &self.parts.self_attn);
        f(
            "post_attention_layernorm",
            &self.parts.post_attention_layernorm,
        );
        f("mlp", &self.parts.mlp);
    }
    fn type_name(&self) -> &'static str {
        "LlamaDecoderLayer"
    }
    fn hooks(&self) -> &ModuleHooks {
        &self.hooks
    }
}

/// The decoder layers of a [`Llama`], children `0`, `1`, … called in order (a typed
/// `Sequential`).
#[derive(Debug)]
pub struct LlamaLayers {
    items: Vec<LlamaDecoderLayer>,
    names: Vec<String>,
    hooks: ModuleHooks,
}

impl LlamaLayers {
    /// The layers, in order.
    pub fn items(&self) -> &[LlamaDecoderLayer] {
        &self.items
    }

    /// Number of layers.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// True if there are no layers.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

impl Module for LlamaLayers {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut x = x.clone();
        for m in &self.items {
            x = m.call(&x)?;
        }
        Ok(x)
    }
    fn visit_params(&self, _f: &mut dyn FnMut(&str, &Parameter)) {}
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(&str, &'a dyn Module)) {
        for (name, m) in self.names.iter().zip(&self.items) {
            f(name, m);
        }
    }
    fn type_name(&self) -> &'static str {
        "LlamaLayers"
    }
    fn hooks(&self) -> &ModuleHooks {
        &self.hooks
    }
}

/// A Llama. Forward takes `i64` token ids `[batch, t]` (`0 < t ≤ seq_len`) and returns logits
/// `[batch, t, vocab]`; train with [`crate::cross_entropy`].
#[derive(Debug)]
pub struct Llama {
    /// Token embedding `[vocab, d]`.
    pub embed_tokens: Embedding,
    /// The decoder layers, named `layers.0`, `layers.1`, …
    pub layers: LlamaLayers,
    /// Final RMSNorm.
    pub norm: RmsNorm,
    /// LM head `[vocab, d]`, no bias; its weight *is* `embed_tokens.weight` when tied.
    pub lm_head: Linear,
    /// The rotary tables every layer shares.
    pub rotary: Arc<RotaryTables>,
    /// The configuration.
    pub config: LlamaConfig,
    hooks: ModuleHooks,
}

impl Llama {
    /// Builds the model in `ctx` (eager or fake) with transformers' init.
    ///
    /// # Errors
    /// [`AutogradError::Argument`] for an invalid configuration; parameter-creation errors.
    pub fn new(ctx: &InitContext, config: &LlamaConfig) -> Result<Llama> {
        config.validate()?;
        let c = config;
        let embed_tokens = Embedding::with_init(
            &ctx.child("embed_tokens"),
            c.vocab,
            c.d_model,
            DType::F32,
            normal(),
        )?;
        let rotary = Arc::new(RotaryTables::new(c));
        let layers_ctx = ctx.child("layers");
        let mut layers = Vec::with_capacity(c.n_layers);
        for i in 0..c.n_layers {
            let ctx = layers_ctx.child(&i.to_string());
            layers.push(LlamaDecoderLayer::new(&ctx, c, Arc::clone(&rotary))?);
        }
        let norm = RmsNorm::new(&ctx.child("norm"), c.d_model, c.rms_eps as f32)?;
        let lm_head = if c.tied {
            Linear::from_params(embed_tokens.weight.clone(), None)?
        } else {
            linear(ctx, "lm_head", c.d_model, c.vocab)?
        };
        Ok(Llama {
            embed_tokens,
            layers: LlamaLayers {
                items: layers,
                names: (0..c.n_layers).map(|i| i.to_string()).collect(),
                hooks: ModuleHooks::new(),
            },
            norm,
            lm_head,
            rotary,
            config: *c,
            hooks: ModuleHooks::new(),
        })
    }
}

impl Module for Llama {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        if ids.dim() != 2 || ids.shape()[1] > self.config.seq_len || ids.shape()[1] == 0 {
            return Err(shape_err(
                "Llama",
                format!(
                    "token ids must be [batch, t] with 0 < t ≤ {}, got {:?}",
                    self.config.seq_len,
                    ids.shape()
                ),
            ));
        }
        let x = self.embed_tokens.call(ids)?;
        let x = self.layers.call(&x)?;
        let x = self.norm.call(&x)?;
        self.lm_head.call(&x)
    }
    fn visit_params(&self, _f: &mut dyn FnMut(&str, &Parameter)) {}
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(&str, &'a dyn Module)) {
        f("embed_tokens", &self.embed_tokens);
        f("layers", &self.layers);
        f("norm", &self.norm);
        f("lm_head", &self.lm_head);
    }
    fn type_name(&self) -> &'static str {
        "Llama"
    }
    fn hooks(&self) -> &ModuleHooks {
        &self.hooks
    }
}
