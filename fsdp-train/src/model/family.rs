//! What the main job needs of a model family ([`Family`]), the built model the ranks wrap
//! ([`Model`]) and the KV-cache decoder sampling runs ([`Decode`]). A leaf of the `model`
//! folder: the families (`gpt.rs`, `llama.rs`) implement [`Family`] for their configuration
//! type, and `mod.rs` names them in [`super::ModelSpec`].

use std::path::Path;
use std::sync::Arc;

use fsdp_alloc::Device;
use fsdp_autograd::kernels::dropout::DropoutKey;
use fsdp_autograd::nn::{Gelu, Gpt, Module, ModuleHooks};
use fsdp_autograd::param::Parameter;
use fsdp_autograd::{AutogradError, InitContext, Tensor};
use fsdp_core::state_dict::FullStateDict;
use fsdp_core::wrap::WrapPolicy;
use fsdp_core::Fsdp;
use fsdp_plan::{ModelDesc, PlanError};

/// A model family's configuration, as the training loop, checkpoints, deferred init, the
/// planner, sampling and the Hugging Face interop see it. Implemented by the configuration type
/// of each family (`GptConfig`, `LlamaConfig`); the rank only ever holds a [`Model`].
pub trait Family: Send + Sync + std::fmt::Debug {
    /// The family's `--model` prefix and fingerprint tag (`gpt`, `llama`).
    fn name(&self) -> &'static str;
    /// Vocabulary size.
    fn vocab(&self) -> usize;
    /// Sets the vocabulary size.
    fn set_vocab(&mut self, vocab: usize);
    /// Tokens per training sequence (and the longest context the model takes).
    fn seq_len(&self) -> usize;
    /// Sets the sequence length.
    fn set_seq_len(&mut self, seq_len: usize);
    /// Model width.
    fn d_model(&self) -> usize;
    /// Number of FSDP units of the family's block type (transformer blocks, decoder layers).
    fn n_layers(&self) -> usize;
    /// True if the embedding and the LM head are one parameter.
    fn tied(&self) -> bool;
    /// True if every block is activation-checkpointed.
    fn checkpointed(&self) -> bool;
    /// Sets activation checkpointing of every block.
    fn set_checkpointed(&mut self, on: bool);
    /// The model's own parameter count (no padding; a tied head counted once).
    fn params(&self) -> u64;
    /// The module type that is one FSDP unit (`Block`, `LlamaDecoderLayer`).
    fn unit_type(&self) -> &'static str;
    /// Applies the command line's shape flags to a preset of the family.
    ///
    /// # Errors
    /// A flag the family does not have (`--gelu tanh` on a Llama, `--kv-heads` on a GPT), as a
    /// usage line.
    fn apply_flags(&mut self, f: &ShapeFlags) -> Result<(), String>;
    /// Checks the sizes (a usage error: one line naming the flags).
    ///
    /// # Errors
    /// What is inconsistent, e.g. a width not divisible by the heads.
    fn validate(&self) -> Result<(), String>;
    /// The banner's description of the shape (`GPT vocab … gelu exact`).
    fn describe(&self) -> String;
    /// The checkpoint fingerprint's model string: parsed back by [`super::ModelSpec::parse`]
    /// (`train_gpt sample --checkpoint-dir`), compared on `--resume`.
    fn fingerprint(&self) -> String;
    /// Builds the model in `ctx` (eager or fake).
    ///
    /// # Errors
    /// Parameter-creation errors; an invalid configuration.
    fn build(&self, ctx: &InitContext) -> Result<Model, AutogradError>;
    /// The planner's description of this model wrapped by `policy` (`--plan`).
    ///
    /// # Errors
    /// [`PlanError::Model`] for sizes the planner cannot describe.
    fn plan_desc(&self, policy: &WrapPolicy) -> Result<ModelDesc, PlanError>;
    /// A KV-cache decoder over a plain model of this configuration on `dev` holding `full`'s
    /// values (`train_gpt sample --device`; dropout off: sampling never sets a key).
    ///
    /// # Errors
    /// A state dict that does not fit the model; device errors.
    fn decoder(&self, full: &FullStateDict, dev: &Device) -> Result<Box<dyn Decode>, String>;
    /// Checks that this model can take the Hugging Face checkpoint at `path` (shape, tying; a
    /// vocabulary at least the file's, a sequence length at most its positions).
    ///
    /// # Errors
    /// The checkpoint cannot be read or does not fit, as one line.
    fn hf_check(&self, path: &Path) -> Result<(), String>;
    /// `--init-from PATH`: this rank's pieces of the Hugging Face checkpoint at `path` into the
    /// wrapped model (rank-local: every rank reads only its own elements).
    ///
    /// # Errors
    /// The checkpoint cannot be read or does not fit, as one line.
    fn hf_load(&self, fsdp: &Fsdp<Model>, path: &Path) -> Result<(), String>;
    /// `--export-hf DIR`: gathers the parameters and writes the Hugging Face directory on rank 0
    /// (a collective: every rank calls it). `source` is the `--init-from` checkpoint, whose
    /// configuration keys that do not change the model a family may carry into the export.
    ///
    /// # Errors
    /// The gather or the write failed, as one line.
    fn hf_export(
        &self,
        fsdp: &Fsdp<Model>,
        source: Option<&Path>,
        dir: &Path,
    ) -> Result<(), String>;
    /// The Hugging Face checkpoint at `path` as a full state dict of this model's parameters
    /// (`train_gpt sample --init-from`).
    ///
    /// # Errors
    /// The checkpoint cannot be read or does not fit, as one line.
    fn hf_full(&self, path: &Path) -> Result<FullStateDict, String>;
}

/// The shape flags of `train_gpt`'s command line (`None`: the preset's value).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShapeFlags {
    /// `--d-model`.
    pub d_model: Option<usize>,
    /// `--layers`.
    pub layers: Option<usize>,
    /// `--heads`.
    pub heads: Option<usize>,
    /// `--kv-heads` (grouped-query attention).
    pub kv_heads: Option<usize>,
    /// `--ffn-dim` (the feed-forward width).
    pub ffn_dim: Option<usize>,
    /// `--gelu` (a GPT's is exact unless given).
    pub gelu: Option<Gelu>,
    /// `--dropout` (GPT-2's three dropouts).
    pub dropout: Option<f32>,
    /// `--tied`.
    pub tied: bool,
    /// `--activation-checkpointing`.
    pub checkpoint: bool,
}

/// Incremental decoding with a KV cache: one token in, the next token's logits out.
pub trait Decode {
    /// Appends `token` at the next position and returns the logits of the token after it
    /// (`vocab` values). A full context is first shrunk to its last half.
    ///
    /// # Errors
    /// A token outside the vocabulary; tensor errors.
    fn step(&mut self, token: u32) -> Result<Vec<f32>, String>;
}

/// A built model of any family: the module tree the ranks wrap with FSDP. Its parameter names,
/// children and hooks are the inner module's (it adds no level to the tree).
pub struct Model {
    inner: Arc<dyn Module>,
    /// The GPT, when the model is one: the family with dropout (`--dropout`), whose key the
    /// trainer sets per micro-batch ([`Model::set_dropout_key`]).
    gpt: Option<Arc<Gpt>>,
}

impl Model {
    /// Wraps a built module (a family without dropout).
    pub fn new(inner: Box<dyn Module>) -> Model {
        Model {
            inner: Arc::from(inner),
            gpt: None,
        }
    }

    /// Wraps a built GPT (its dropout key is set through [`Model::set_dropout_key`]).
    pub fn gpt(gpt: Gpt) -> Model {
        let gpt = Arc::new(gpt);
        Model {
            inner: gpt.clone(),
            gpt: Some(gpt),
        }
    }

    /// Turns dropout on (a training micro-batch's `key`) or off (`None`) for the following
    /// forwards (`Gpt::set_dropout_key`); a family without dropout ignores it.
    pub fn set_dropout_key(&self, key: Option<DropoutKey>) {
        if let Some(g) = &self.gpt {
            g.set_dropout_key(key);
        }
    }
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("type", &self.inner.type_name())
            .finish()
    }
}

impl Module for Model {
    fn forward(&self, x: &Tensor) -> Result<Tensor, AutogradError> {
        self.inner.forward(x)
    }
    fn visit_params(&self, f: &mut dyn FnMut(&str, &Parameter)) {
        self.inner.visit_params(f)
    }
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(&str, &'a dyn Module)) {
        self.inner.visit_children(f)
    }
    fn type_name(&self) -> &'static str {
        self.inner.type_name()
    }
    fn hooks(&self) -> &ModuleHooks {
        self.inner.hooks()
    }
}
