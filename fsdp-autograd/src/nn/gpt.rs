//! A small GPT (GPT-2 architecture): token + positional embeddings, pre-LN blocks of causal
//! self-attention and a GELU MLP, a final layer norm and an LM head (optionally tied to the token
//! embedding: the same [`Parameter`] in two modules).
//!
//! Init as GPT-2 / nanoGPT: every weight Normal(0, 0.02), the two residual projections of each
//! block additionally scaled by `1/√(2·n_layers)` (recorded as a `Scale` op), biases zero, layer
//! norms ones/zeros.

use std::sync::Arc;

use fsdp_alloc::DType;

use crate::autograd::checkpoint;
use crate::error::{shape_err, AutogradError, Result};
use crate::init::InitOp;
use crate::kernels::Gelu;
use crate::nn::{Embedding, LayerNorm, Linear, Module, ModuleHooks, Sequential};
use crate::ops;
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

/// Hyper-parameters of a [`Gpt`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Model width (divisible by `n_heads`).
    pub d_model: usize,
    /// Number of blocks.
    pub n_layers: usize,
    /// Attention heads per block.
    pub n_heads: usize,
    /// Maximum sequence length (positional table size).
    pub seq_len: usize,
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
            tied: false,
            checkpoint: false,
            gelu: Gelu::Exact,
        }
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
        if self.vocab == 0
            || self.d_model == 0
            || self.n_heads == 0
            || self.seq_len == 0
            || self.d_model % self.n_heads != 0
        {
            return Err(AutogradError::Argument {
                op: "GptConfig",
                detail: format!(
                    "{self:?}: sizes must be positive and d_model divisible by n_heads"
                ),
            });
        }
        Ok(())
    }
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
    hooks: ModuleHooks,
}

impl CausalSelfAttention {
    /// GPT-2 init; `proj` scaled by `proj_scale`.
    pub fn new(ctx: &InitContext, d: usize, n_heads: usize, proj_scale: f32) -> Result<Self> {
        Ok(CausalSelfAttention {
            qkv: biased(ctx, "qkv", d, 3 * d, normal())?,
            proj: biased(ctx, "proj", d, d, scaled_normal(proj_scale))?,
            n_heads,
            hooks: ModuleHooks::new(),
        })
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
        let y = ops::causal_attention_qkv(&qkv, self.n_heads)?; // [b, t, d]
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

/// The feed-forward part of a block: `proj(gelu(fc(x)))` with a 4× hidden width.
#[derive(Debug)]
pub struct Mlp {
    /// `[4d, d]`.
    pub fc: Linear,
    /// `[d, 4d]`.
    pub proj: Linear,
    /// The activation (exact GELU unless set otherwise).
    pub gelu: Gelu,
    hooks: ModuleHooks,
}

impl Mlp {
    /// GPT-2 init; `proj` scaled by `proj_scale`.
    pub fn new(ctx: &InitContext, d: usize, proj_scale: f32) -> Result<Mlp> {
        Ok(Mlp {
            fc: biased(ctx, "fc", d, 4 * d, normal())?,
            proj: biased(ctx, "proj", 4 * d, d, scaled_normal(proj_scale))?,
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
}

impl BlockLayers {
    fn run(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.add(&self.attn.call(&self.ln1.call(x)?)?)?;
        x.add(&self.mlp.call(&self.ln2.call(&x)?)?)
    }
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
        let proj_scale = 1.0 / (2.0 * n_layers.max(1) as f32).sqrt();
        Ok(Block {
            layers: Arc::new(BlockLayers {
                ln1: LayerNorm::new(&ctx.child("ln1"), d)?,
                attn: CausalSelfAttention::new(&ctx.child("attn"), d, n_heads, proj_scale)?,
                ln2: LayerNorm::new(&ctx.child("ln2"), d)?,
                mlp: Mlp::new(&ctx.child("mlp"), d, proj_scale)?.with_gelu(gelu),
            }),
            checkpoint,
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
            let mut out = checkpoint(
                move |xs: &[Tensor]| Ok(vec![layers.run(&xs[0])?]),
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

/// A small GPT. Forward takes `i64` token ids `[batch, t]` (`t ≤ seq_len`) and returns logits
/// `[batch, t, vocab]`; train with [`crate::cross_entropy`].
#[derive(Debug)]
pub struct Gpt {
    /// Token embedding `[vocab, d]`.
    pub tok_emb: Embedding,
    /// Positional embedding `[seq_len, d]`.
    pub pos_emb: Embedding,
    /// The blocks, named `blocks.0`, `blocks.1`, …
    pub blocks: Sequential,
    /// Final layer norm.
    pub ln_f: LayerNorm,
    /// LM head `[vocab, d]`, no bias; its weight *is* `tok_emb.weight` when tied.
    pub head: Linear,
    /// The configuration.
    pub config: GptConfig,
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
            config.seq_len,
            d,
            DType::F32,
            normal(),
        )?;
        let blocks_ctx = ctx.child("blocks");
        let mut blocks: Vec<Box<dyn Module>> = Vec::with_capacity(config.n_layers);
        for i in 0..config.n_layers {
            blocks.push(Box::new(Block::with_gelu(
                &blocks_ctx.child(&i.to_string()),
                d,
                config.n_heads,
                config.n_layers,
                config.checkpoint,
                config.gelu,
            )?));
        }
        let ln_f = LayerNorm::new(&ctx.child("ln_f"), d)?;
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
            hooks: ModuleHooks::new(),
        })
    }
}

impl Module for Gpt {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        if ids.dim() != 2 || ids.shape()[1] > self.config.seq_len || ids.shape()[1] == 0 {
            return Err(shape_err(
                "Gpt",
                format!(
                    "token ids must be [batch, t] with 0 < t ≤ {}, got {:?}",
                    self.config.seq_len,
                    ids.shape()
                ),
            ));
        }
        let t = ids.shape()[1];
        let positions = Tensor::arange(t, ids.device())?;
        let x = self
            .tok_emb
            .call(ids)?
            .add(&self.pos_emb.call(&positions)?)?;
        let x = self.blocks.call(&x)?;
        let x = self.ln_f.call(&x)?;
        self.head.call(&x)
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
