//! A small GPT (GPT-2 architecture): token + positional embeddings, pre-LN blocks of causal
//! self-attention and a GELU MLP, a final layer norm and an LM head (optionally tied to the token
//! embedding: the same [`Parameter`] in two modules).
//!
//! Init as GPT-2 / nanoGPT: every weight Normal(0, 0.02), the two residual projections of each
//! block additionally scaled by `1/√(2·n_layers)` (recorded as a `Scale` op), biases zero, layer
//! norms ones/zeros.
//!
//! The configuration carries the GPT-2 options that change the computation as transformers'
//! `GPT2LMHeadModel` computes them: the position table's size (`n_positions`, which may exceed
//! the training sequence), the MLP width (`n_inner`), the layer norms' epsilon, how attention
//! scores are scaled ([`AttnScaling`]: `scale_attn_weights`, `scale_attn_by_inverse_layer_idx`)
//! and the three dropouts ([`GptDropout`]).
//!
//! **Dropout** is applied only in training forwards: after [`Gpt::set_dropout_key`] with a key
//! (seed, step, first sample; the trainer sets it per micro-batch and clears it after), GPT-2's
//! three places drop — the embedding sum (`embd`, site 0), the attention probabilities (`attn`,
//! site `3·layer + 1`) and each residual branch's output (`resid`: attention projection, site
//! `3·layer + 2`; MLP, site `3·layer + 3`). The masks are counter-based
//! ([`crate::kernels::dropout`]): a function of the key, the site, the sample's global index and
//! the element, so a recomputed (activation-checkpointed) block draws the same masks, and a
//! sample gets the same masks on whichever rank or micro-batch it is trained. Without a key (the
//! default: evaluation, sampling) nothing is dropped. Attention-probability dropout runs the
//! composite attention of [`crate::ops::causal_attention_qkv_dropout`] (quadratic memory in the
//! sequence length; see its cost) instead of the fused kernels.

use std::cell::Cell;
use std::sync::{Arc, Mutex};

use fsdp_alloc::DType;

use crate::autograd::checkpoint;
use crate::error::{shape_err, AutogradError, Result};
use crate::init::InitOp;
use crate::kernels::dropout::DropoutKey;
use crate::kernels::Gelu;
use crate::nn::{Embedding, LayerNorm, Linear, Module, ModuleHooks, Sequential};
use crate::ops;
use crate::ops::ProbDropout;
use crate::param::{InitContext, Parameter};
use crate::tensor::Tensor;

const STD: f32 = 0.02;

fn normal() -> Vec<InitOp> {
    vec![InitOp::Normal {
        mean: 0.0,
        std: STD,
    }]
}

fn zeros() -> Vec<InitOp> {
    vec![InitOp::Fill(0.0)]
}

/// The residual projections' weight init: [`normal`] scaled by `proj_scale`.
fn scaled_normal(proj_scale: f32) -> Vec<InitOp> {
    let mut ops = normal();
    ops.push(InitOp::Scale(proj_scale));
    ops
}

/// A biased `f32` layer `name` of `d_in → d_out` with weight init `weight` and zero bias.
fn biased(
    ctx: &InitContext,
    name: &str,
    d_in: usize,
    d_out: usize,
    weight: Vec<InitOp>,
) -> Result<Linear> {
    Linear::with_init(
        &ctx.child(name),
        d_in,
        d_out,
        true,
        DType::F32,
        weight,
        zeros(),
    )
}

/// GPT-2's dropout probabilities (`embd_pdrop`, `attn_pdrop`, `resid_pdrop`), each in `[0, 1)`;
/// applied only in training forwards (see [`Gpt::set_dropout_key`]). All zero by default.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct GptDropout {
    /// After the token + position embedding sum.
    pub embd: f32,
    /// On the attention probabilities.
    pub attn: f32,
    /// On the output of each residual branch (attention projection, MLP).
    pub resid: f32,
}

impl GptDropout {
    /// The same probability `p` at all three places.
    pub fn all(p: f32) -> GptDropout {
        GptDropout {
            embd: p,
            attn: p,
            resid: p,
        }
    }

    /// True if nothing is ever dropped.
    pub fn is_off(&self) -> bool {
        self.embd == 0.0 && self.attn == 0.0 && self.resid == 0.0
    }
}

/// How attention scores `q·kᵀ` are scaled before the softmax, as GPT-2's config says it:
/// `1/√head_dim` when `by_head_dim` (`scale_attn_weights`, the default), times `1/(layer + 1)`
/// when `by_inverse_layer` (`scale_attn_by_inverse_layer_idx`, layers counted from 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttnScaling {
    /// `scale_attn_weights`.
    pub by_head_dim: bool,
    /// `scale_attn_by_inverse_layer_idx`.
    pub by_inverse_layer: bool,
}

impl Default for AttnScaling {
    fn default() -> Self {
        AttnScaling {
            by_head_dim: true,
            by_inverse_layer: false,
        }
    }
}

impl AttnScaling {
    /// The factor of layer `layer` (0-based) for heads of `head_dim`: computed in f64 as
    /// transformers does (`head_dim ** -0.5`, then `/ (layer + 1)`), rounded to f32.
    pub fn scale(&self, head_dim: usize, layer: usize) -> f32 {
        let mut s = 1.0f64;
        if self.by_head_dim {
            s = (head_dim as f64).powf(-0.5);
        }
        if self.by_inverse_layer {
            s /= (layer + 1) as f64;
        }
        s as f32
    }
}

/// Hyper-parameters of a [`Gpt`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Model width (divisible by `n_heads`).
    pub d_model: usize,
    /// Number of blocks.
    pub n_layers: usize,
    /// Attention heads per block.
    pub n_heads: usize,
    /// Training sequence length (tokens per sequence); the position table has
    /// [`GptConfig::positions`] rows (at least this many).
    pub seq_len: usize,
    /// Rows of the position table (GPT-2's `n_positions`) when larger than `seq_len`; `None`:
    /// `seq_len`. The forward accepts sequences up to [`GptConfig::positions`].
    pub n_positions: Option<usize>,
    /// The MLP's hidden width (GPT-2's `n_inner`); `None`: `4·d_model`.
    pub n_inner: Option<usize>,
    /// The layer norms' epsilon (GPT-2's `layer_norm_epsilon`, 1e-5 by default).
    pub ln_eps: f32,
    /// How attention scores are scaled.
    pub attn_scaling: AttnScaling,
    /// Dropout probabilities (training forwards only).
    pub dropout: GptDropout,
    /// Tie the LM head to the token embedding.
    pub tied: bool,
    /// Activation checkpointing of every block.
    pub checkpoint: bool,
    /// The MLP's activation: exact (erf) GELU by default, as PyTorch's `nn.GELU()`; GPT-2's tanh
    /// approximation on request.
    pub gelu: Gelu,
}

impl GptConfig {
    /// A configuration without tying or checkpointing, with exact GELU.
    pub fn new(
        vocab: usize,
        d_model: usize,
        n_layers: usize,
        n_heads: usize,
        seq_len: usize,
    ) -> GptConfig {
        GptConfig {
            vocab,
            d_model,
            n_layers,
            n_heads,
            seq_len,
            n_positions: None,
            n_inner: None,
            ln_eps: 1e-5,
            attn_scaling: AttnScaling::default(),
            dropout: GptDropout::default(),
            tied: false,
            checkpoint: false,
            gelu: Gelu::Exact,
        }
    }

    /// Rows of the position table: `n_positions`, or `seq_len` without it.
    pub fn positions(&self) -> usize {
        self.n_positions.unwrap_or(self.seq_len).max(self.seq_len)
    }

    /// The MLP's hidden width: `n_inner`, or `4·d_model` without it.
    pub fn inner(&self) -> usize {
        self.n_inner.unwrap_or(4 * self.d_model)
    }

    /// The attention scale of block `layer` (0-based).
    pub fn attn_scale(&self, layer: usize) -> f32 {
        self.attn_scaling
            .scale(self.d_model / self.n_heads.max(1), layer)
    }

    /// With a position table of `n` rows (GPT-2's `n_positions`; at least `seq_len`).
    pub fn with_positions(mut self, n: usize) -> GptConfig {
        self.n_positions = Some(n);
        self
    }

    /// With an MLP hidden width of `n` (GPT-2's `n_inner`).
    pub fn with_inner(mut self, n: usize) -> GptConfig {
        self.n_inner = Some(n);
        self
    }

    /// With layer-norm epsilon `eps`.
    pub fn with_ln_eps(mut self, eps: f32) -> GptConfig {
        self.ln_eps = eps;
        self
    }

    /// With attention scaling `s`.
    pub fn with_attn_scaling(mut self, s: AttnScaling) -> GptConfig {
        self.attn_scaling = s;
        self
    }

    /// With dropout probabilities `d`.
    pub fn with_dropout(mut self, d: GptDropout) -> GptConfig {
        self.dropout = d;
        self
    }

    /// The benchmark model "GPT-mini": vocab 256, d 256, 4 layers, 4 heads, seq 128.
    pub fn mini() -> GptConfig {
        GptConfig::new(256, 256, 4, 4, 128)
    }

    /// A tiny model for tests: vocab 32, d 32, 2 layers, 2 heads, seq 16.
    pub fn tiny() -> GptConfig {
        GptConfig::new(32, 32, 2, 2, 16)
    }

    /// With `tied` set.
    pub fn with_tied(mut self, tied: bool) -> GptConfig {
        self.tied = tied;
        self
    }

    /// With `checkpoint` set.
    pub fn with_checkpoint(mut self, checkpoint: bool) -> GptConfig {
        self.checkpoint = checkpoint;
        self
    }

    /// With the MLP activation `gelu`.
    pub fn with_gelu(mut self, gelu: Gelu) -> GptConfig {
        self.gelu = gelu;
        self
    }

    fn validate(&self) -> Result<()> {
        let bad = |detail: String| {
            Err(AutogradError::Argument {
                op: "GptConfig",
                detail,
            })
        };
        if self.vocab == 0
            || self.d_model == 0
            || self.n_heads == 0
            || self.seq_len == 0
            || self.d_model % self.n_heads != 0
            || self.inner() == 0
        {
            return bad(format!(
                "{self:?}: sizes must be positive and d_model divisible by n_heads"
            ));
        }
        if self.n_positions.is_some_and(|n| n < self.seq_len) {
            return bad(format!("{self:?}: n_positions must be at least seq_len"));
        }
        if !(self.ln_eps.is_finite() && self.ln_eps >= 0.0) {
            return bad(format!(
                "layer-norm epsilon {} must be finite and ≥ 0",
                self.ln_eps
            ));
        }
        let d = self.dropout;
        for (name, p) in [("embd", d.embd), ("attn", d.attn), ("resid", d.resid)] {
            if !(0.0..1.0).contains(&p) {
                return bad(format!("{name} dropout {p} is not in [0, 1)"));
            }
        }
        Ok(())
    }
}

thread_local! {
    /// The dropout key of the training forward running on this thread: set by [`Gpt`]'s forward
    /// (from [`Gpt::set_dropout_key`]) and by a checkpointed block's recomputation (the key its
    /// forward ran with), read by the blocks and attentions inside.
    static FORWARD_KEY: Cell<Option<DropoutKey>> = const { Cell::new(None) };
}

/// Runs `f` with `key` as this thread's forward key, restoring the previous one afterwards.
fn with_forward_key<T>(key: Option<DropoutKey>, f: impl FnOnce() -> T) -> T {
    struct Restore(Option<DropoutKey>);
    impl Drop for Restore {
        fn drop(&mut self) {
            FORWARD_KEY.with(|k| k.set(self.0));
        }
    }
    let _restore = Restore(FORWARD_KEY.with(|k| k.replace(key)));
    f()
}

/// This thread's forward key (`None` outside a training forward).
fn forward_key() -> Option<DropoutKey> {
    FORWARD_KEY.with(Cell::get)
}

/// `1/√head_dim` as f32 (the fused attention kernels' scale).
fn default_scale(head_dim: usize) -> f32 {
    AttnScaling::default().scale(head_dim, 0)
}

/// Multi-head causal self-attention: `qkv` projection, per-head causal attention, output `proj`.
#[derive(Debug)]
pub struct CausalSelfAttention {
    /// `[3d, d]` projection to queries, keys and values.
    pub qkv: Linear,
    /// `[d, d]` output projection.
    pub proj: Linear,
    /// Number of heads.
    pub n_heads: usize,
    /// The factor of the scores `q·kᵀ` (`1/√head_dim` unless set otherwise).
    pub scale: f32,
    /// Dropout probability of the attention probabilities (training forwards only).
    pub attn_pdrop: f32,
    /// The dropout site of the probabilities.
    pub site: u32,
    hooks: ModuleHooks,
}

impl CausalSelfAttention {
    /// GPT-2 init; `proj` scaled by `proj_scale`; scores scaled by `1/√head_dim`, no dropout.
    pub fn new(ctx: &InitContext, d: usize, n_heads: usize, proj_scale: f32) -> Result<Self> {
        Ok(CausalSelfAttention {
            qkv: biased(ctx, "qkv", d, 3 * d, normal())?,
            proj: biased(ctx, "proj", d, d, scaled_normal(proj_scale))?,
            n_heads,
            scale: default_scale(d / n_heads.max(1)),
            attn_pdrop: 0.0,
            site: 0,
            hooks: ModuleHooks::new(),
        })
    }

    /// With the scores scaled by `scale`.
    pub fn with_scale(mut self, scale: f32) -> Self {
        self.scale = scale;
        self
    }

    /// With dropout `p` of the probabilities at dropout site `site` (in training forwards).
    pub fn with_dropout(mut self, p: f32, site: u32) -> Self {
        self.attn_pdrop = p;
        self.site = site;
        self
    }
}

impl Module for CausalSelfAttention {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.dim() != 3 {
            return Err(shape_err(
                "CausalSelfAttention",
                format!("input must be [batch, t, d], got {:?}", x.shape()),
            ));
        }
        let qkv = self.qkv.call(x)?; // [b, t, 3d] = [b, t, 3, h, dh]
        let drop = forward_key()
            .filter(|_| self.attn_pdrop > 0.0)
            .map(|key| ProbDropout {
                p: self.attn_pdrop,
                key,
                site: self.site,
            });
        let dh = x.shape()[2] / self.n_heads.max(1);
        let y = if drop.is_some() || self.scale != default_scale(dh) {
            ops::causal_attention_qkv_dropout(&qkv, self.n_heads, self.scale, drop)?
        } else {
            ops::causal_attention_qkv(&qkv, self.n_heads)? // [b, t, d]
        };
        self.proj.call(&y)
    }
    fn visit_params(&self, _f: &mut dyn FnMut(&str, &Parameter)) {}
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(&str, &'a dyn Module)) {
        f("qkv", &self.qkv);
        f("proj", &self.proj);
    }
    fn type_name(&self) -> &'static str {
        "CausalSelfAttention"
    }
    fn hooks(&self) -> &ModuleHooks {
        &self.hooks
    }
}

/// The feed-forward part of a block: `proj(gelu(fc(x)))` with a hidden width of `4·d` (or
/// GPT-2's `n_inner`).
#[derive(Debug)]
pub struct Mlp {
    /// `[inner, d]`.
    pub fc: Linear,
    /// `[d, inner]`.
    pub proj: Linear,
    /// The activation (exact GELU unless set otherwise).
    pub gelu: Gelu,
    hooks: ModuleHooks,
}

impl Mlp {
    /// GPT-2 init; `proj` scaled by `proj_scale`; hidden width `4·d`.
    pub fn new(ctx: &InitContext, d: usize, proj_scale: f32) -> Result<Mlp> {
        Mlp::with_width(ctx, d, 4 * d, proj_scale)
    }

    /// As [`Mlp::new`] with hidden width `inner`.
    pub fn with_width(ctx: &InitContext, d: usize, inner: usize, proj_scale: f32) -> Result<Mlp> {
        Ok(Mlp {
            fc: biased(ctx, "fc", d, inner, normal())?,
            proj: biased(ctx, "proj", inner, d, scaled_normal(proj_scale))?,
            gelu: Gelu::Exact,
            hooks: ModuleHooks::new(),
        })
    }

    /// With the activation `gelu`.
    pub fn with_gelu(mut self, gelu: Gelu) -> Mlp {
        self.gelu = gelu;
        self
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.proj.call(&self.fc.call(x)?.gelu_with(self.gelu)?)
    }
    fn visit_params(&self, _f: &mut dyn FnMut(&str, &Parameter)) {}
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(&str, &'a dyn Module)) {
        f("fc", &self.fc);
        f("proj", &self.proj);
    }
    fn type_name(&self) -> &'static str {
        "Mlp"
    }
    fn hooks(&self) -> &ModuleHooks {
        &self.hooks
    }
}

/// The layers of a block (shared with the checkpoint closure).
#[derive(Debug)]
struct BlockLayers {
    ln1: LayerNorm,
    attn: CausalSelfAttention,
    ln2: LayerNorm,
    mlp: Mlp,
    /// Residual dropout of the two branches (training forwards only).
    resid_pdrop: f32,
    /// The block's index (its dropout sites are `3·layer + 1 ..= 3·layer + 3`).
    layer: usize,
}

impl BlockLayers {
    fn run(&self, x: &Tensor) -> Result<Tensor> {
        let a = self.attn.call(&self.ln1.call(x)?)?;
        let x = x.add(&self.resid_drop(a, 2)?)?;
        let m = self.mlp.call(&self.ln2.call(&x)?)?;
        x.add(&self.resid_drop(m, 3)?)
    }

    /// Residual dropout of branch output `t` at site `3·layer + k`, in a training forward.
    fn resid_drop(&self, t: Tensor, k: usize) -> Result<Tensor> {
        match forward_key() {
            Some(key) if self.resid_pdrop > 0.0 => {
                ops::dropout(&t, self.resid_pdrop, key, site(3 * self.layer + k))
            }
            _ => Ok(t),
        }
    }
}

/// Dropout site `n` as the kernels' `u32` (a model has at most 3·layers + 1 sites).
fn site(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// A pre-LN transformer block: `x + attn(ln1(x))`, then `x + mlp(ln2(x))`; optionally
/// activation-checkpointed (recomputed in backward).
#[derive(Debug)]
pub struct Block {
    layers: Arc<BlockLayers>,
    checkpoint: bool,
    hooks: ModuleHooks,
}

impl Block {
    /// A block of width `d` with `n_heads` heads in a model of `n_layers` blocks (exact GELU).
    pub fn new(
        ctx: &InitContext,
        d: usize,
        n_heads: usize,
        n_layers: usize,
        checkpoint: bool,
    ) -> Result<Block> {
        Block::with_gelu(ctx, d, n_heads, n_layers, checkpoint, Gelu::Exact)
    }

    /// As [`Block::new`] with the MLP activation `gelu`.
    pub fn with_gelu(
        ctx: &InitContext,
        d: usize,
        n_heads: usize,
        n_layers: usize,
        checkpoint: bool,
        gelu: Gelu,
    ) -> Result<Block> {
        let mut g = GptConfig::new(1, d, n_layers, n_heads, 1);
        g.gelu = gelu;
        g.checkpoint = checkpoint;
        Block::for_layer(ctx, &g, 0)
    }

    /// Block `layer` (0-based) of a [`Gpt`] of `config`: its width, heads, MLP width and
    /// activation, layer-norm epsilon, attention scale of that layer, and dropouts.
    pub fn for_layer(ctx: &InitContext, config: &GptConfig, layer: usize) -> Result<Block> {
        let (d, drop) = (config.d_model, config.dropout);
        let proj_scale = 1.0 / (2.0 * config.n_layers.max(1) as f32).sqrt();
        let ln = |name: &str| -> Result<LayerNorm> {
            let mut l = LayerNorm::new(&ctx.child(name), d)?;
            l.eps = config.ln_eps;
            Ok(l)
        };
        let attn = CausalSelfAttention::new(&ctx.child("attn"), d, config.n_heads, proj_scale)?
            .with_scale(config.attn_scale(layer))
            .with_dropout(drop.attn, site(3 * layer + 1));
        let mlp = Mlp::with_width(&ctx.child("mlp"), d, config.inner(), proj_scale)?;
        Ok(Block {
            layers: Arc::new(BlockLayers {
                ln1: ln("ln1")?,
                attn,
                ln2: ln("ln2")?,
                mlp: mlp.with_gelu(config.gelu),
                resid_pdrop: drop.resid,
                layer,
            }),
            checkpoint: config.checkpoint,
            hooks: ModuleHooks::new(),
        })
    }

    /// True if the block is activation-checkpointed.
    pub fn is_checkpointed(&self) -> bool {
        self.checkpoint
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.checkpoint {
            let layers = Arc::clone(&self.layers);
            // The recomputation in backward draws the dropout masks of this forward.
            let key = forward_key();
            let mut out = checkpoint(
                move |xs: &[Tensor]| with_forward_key(key, || Ok(vec![layers.run(&xs[0])?])),
                std::slice::from_ref(x),
            )?;
            Ok(out.pop().expect("one output"))
        } else {
            self.layers.run(x)
        }
    }
    fn visit_params(&self, _f: &mut dyn FnMut(&str, &Parameter)) {}
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(&str, &'a dyn Module)) {
        f("ln1", &self.layers.ln1);
        f("attn", &self.layers.attn);
        f("ln2", &self.layers.ln2);
        f("mlp", &self.layers.mlp);
    }
    fn type_name(&self) -> &'static str {
        "Block"
    }
    fn hooks(&self) -> &ModuleHooks {
        &self.hooks
    }
}

/// A small GPT. Forward takes `i64` token ids `[batch, t]` (`t ≤` [`GptConfig::positions`]) and
/// returns logits `[batch, t, vocab]`; train with [`crate::cross_entropy`].
#[derive(Debug)]
pub struct Gpt {
    /// Token embedding `[vocab, d]`.
    pub tok_emb: Embedding,
    /// Positional embedding `[positions, d]` ([`GptConfig::positions`]).
    pub pos_emb: Embedding,
    /// The blocks, named `blocks.0`, `blocks.1`, …
    pub blocks: Sequential,
    /// Final layer norm.
    pub ln_f: LayerNorm,
    /// LM head `[vocab, d]`, no bias; its weight *is* `tok_emb.weight` when tied.
    pub head: Linear,
    /// The configuration.
    pub config: GptConfig,
    /// The dropout key of the next forwards (`None`: no dropout).
    train_key: Mutex<Option<DropoutKey>>,
    hooks: ModuleHooks,
}

impl Gpt {
    /// Builds the model in `ctx` (eager or fake) with GPT-2 init.
    ///
    /// # Errors
    /// [`AutogradError::Argument`] for an invalid configuration; parameter-creation errors.
    pub fn new(ctx: &InitContext, config: &GptConfig) -> Result<Gpt> {
        config.validate()?;
        let d = config.d_model;
        let tok_emb =
            Embedding::with_init(&ctx.child("tok_emb"), config.vocab, d, DType::F32, normal())?;
        let pos_emb = Embedding::with_init(
            &ctx.child("pos_emb"),
            config.positions(),
            d,
            DType::F32,
            normal(),
        )?;
        let blocks_ctx = ctx.child("blocks");
        let mut blocks: Vec<Box<dyn Module>> = Vec::with_capacity(config.n_layers);
        for i in 0..config.n_layers {
            let b = Block::for_layer(&blocks_ctx.child(&i.to_string()), config, i)?;
            blocks.push(Box::new(b));
        }
        let mut ln_f = LayerNorm::new(&ctx.child("ln_f"), d)?;
        ln_f.eps = config.ln_eps;
        let head = if config.tied {
            Linear::from_params(tok_emb.weight.clone(), None)?
        } else {
            Linear::with_init(
                &ctx.child("head"),
                d,
                config.vocab,
                false,
                DType::F32,
                normal(),
                vec![],
            )?
        };
        Ok(Gpt {
            tok_emb,
            pos_emb,
            blocks: Sequential::new(blocks),
            ln_f,
            head,
            config: *config,
            train_key: Mutex::new(None),
            hooks: ModuleHooks::new(),
        })
    }

    /// Turns dropout on for the following forwards with `key` (a training forward: seed, step
    /// and the global index of the batch's first sample), or off with `None` (the default;
    /// evaluation and sampling). A trainer sets the key of each micro-batch before its forward
    /// and clears it after its backward. Without dropout probabilities it changes nothing.
    pub fn set_dropout_key(&self, key: Option<DropoutKey>) {
        *self.train_key.lock().unwrap_or_else(|e| e.into_inner()) = key;
    }

    /// The key set by [`Gpt::set_dropout_key`].
    pub fn dropout_key(&self) -> Option<DropoutKey> {
        *self.train_key.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Module for Gpt {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let positions = self.config.positions();
        if ids.dim() != 2 || ids.shape()[1] > positions || ids.shape()[1] == 0 {
            return Err(shape_err(
                "Gpt",
                format!(
                    "token ids must be [batch, t] with 0 < t ≤ {positions}, got {:?}",
                    ids.shape()
                ),
            ));
        }
        let key = self.dropout_key().filter(|_| !self.config.dropout.is_off());
        with_forward_key(key, || {
            let t = ids.shape()[1];
            let positions = Tensor::arange(t, ids.device())?;
            let x = self
                .tok_emb
                .call(ids)?
                .add(&self.pos_emb.call(&positions)?)?;
            let x = match key {
                Some(key) if self.config.dropout.embd > 0.0 => {
                    ops::dropout(&x, self.config.dropout.embd, key, 0)?
                }
                _ => x,
            };
            let x = self.blocks.call(&x)?;
            let x = self.ln_f.call(&x)?;
            self.head.call(&x)
        })
    }
    fn visit_params(&self, _f: &mut dyn FnMut(&str, &Parameter)) {}
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(&str, &'a dyn Module)) {
        f("tok_emb", &self.tok_emb);
        f("pos_emb", &self.pos_emb);
        f("blocks", &self.blocks);
        f("ln_f", &self.ln_f);
        f("head", &self.head);
    }
    fn type_name(&self) -> &'static str {
        "Gpt"
    }
    fn hooks(&self) -> &ModuleHooks {
        &self.hooks
    }
}
