//! Model families: what `train_gpt` trains. [`ModelSpec`] is the validated choice (one variant
//! per family, holding that family's configuration); everything the main job does with a model
//! — build it on the rank's init context, name its FSDP unit type, fingerprint it for
//! checkpoints, describe it to the planner, decode with a KV cache, load and export Hugging Face
//! weights — goes through the [`Family`] trait, which each family implements for its
//! configuration type in its own file:
//!
//! - `gpt.rs`: `nn::Gpt` (`--model mini|small|gpt2`), Hugging Face `GPT2LMHeadModel`.
//! - `llama.rs`: `nn::Llama` (`--model llama-tiny|llama-small|llama-1b|llama-8b`), Hugging Face
//!   `LlamaForCausalLM`.
//!
//! A new family is one file here implementing [`Family`] (with its decoder), one [`ModelSpec`]
//! variant (its arms in [`ModelSpec::family`], [`ModelSpec::family_mut`], [`ModelSpec::parse`]
//! and, with a Hugging Face layout, [`ModelSpec::from_hf`]) and its `--model` presets in
//! `cli.rs`.

mod family;
mod gpt;
mod llama;

pub use family::{Decode, Family, Model, ShapeFlags};
#[cfg(test)]
pub use gpt::GptDecoder;

use std::ops::{Deref, DerefMut};
use std::path::Path;

use fsdp_autograd::nn::{GptConfig, LlamaConfig};

use crate::hf::{self, Arch, HfCheckpoint, LlamaCheckpoint};

/// The model a run trains: one variant per family.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelSpec {
    /// `nn::Gpt`.
    Gpt(GptConfig),
    /// `nn::Llama`.
    Llama(LlamaConfig),
}

impl ModelSpec {
    /// The family's view of the configuration.
    pub fn family(&self) -> &(dyn Family + 'static) {
        match self {
            ModelSpec::Gpt(g) => g,
            ModelSpec::Llama(l) => l,
        }
    }

    /// The family's view of the configuration, mutable.
    pub fn family_mut(&mut self) -> &mut (dyn Family + 'static) {
        match self {
            ModelSpec::Gpt(g) => g,
            ModelSpec::Llama(l) => l,
        }
    }

    /// The GPT configuration, if this is a GPT.
    #[cfg(test)]
    pub fn as_gpt(&self) -> Option<&GptConfig> {
        match self {
            ModelSpec::Gpt(g) => Some(g),
            ModelSpec::Llama(_) => None,
        }
    }

    /// Parses a checkpoint fingerprint's model string ([`Family::fingerprint`]): a family tag
    /// first (`llama …`), none for a GPT (the format older checkpoints carry).
    ///
    /// # Errors
    /// A missing or malformed field, naming it.
    pub fn parse(s: &str) -> Result<ModelSpec, String> {
        match s.split_whitespace().next() {
            Some("llama") => Ok(ModelSpec::Llama(llama::parse(s)?)),
            _ => Ok(ModelSpec::Gpt(gpt::parse(s)?)),
        }
    }

    /// The model a Hugging Face checkpoint at `path` (a directory, or its weights file)
    /// describes, from its `config.json`, with a line describing it for the run's notes.
    ///
    /// # Errors
    /// The checkpoint cannot be read or is of no supported layout, as one line.
    pub fn from_hf(path: &Path) -> Result<(ModelSpec, String), String> {
        if hf::detect(path) == Arch::Llama {
            let ck = LlamaCheckpoint::open(path).map_err(|e| format!("--init-from: {e}"))?;
            let (c, max) = (ck.config.model, ck.config.max_positions);
            let note = format!(
                "{} (Llama vocab {} d {} layers {} heads {} kv heads {} ffn {} positions {max}, \
                 seq {}, θ {}{})",
                ck.path().display(),
                c.vocab,
                c.d_model,
                c.n_layers,
                c.n_heads,
                c.n_kv_heads,
                c.ffn_dim,
                c.seq_len,
                c.rope_theta,
                if c.rope_scaling.is_some() {
                    ", llama3 scaling"
                } else {
                    ""
                }
            );
            return Ok((ModelSpec::Llama(c), note));
        }
        let ck = HfCheckpoint::open(path).map_err(|e| format!("--init-from: {e}"))?;
        let (cf, g) = (&ck.config, ck.config.gpt());
        let note = format!(
            "{} (GPT-2 vocab {} d {} layers {} heads {} positions {} inner {}, {} ({} GELU), \
             layer-norm eps {}, attention scale {}{}, {}tied)",
            ck.path().display(),
            cf.vocab,
            cf.d_model,
            cf.n_layers,
            cf.n_heads,
            cf.n_positions,
            g.inner(),
            cf.activation,
            g.gelu.name(),
            cf.ln_eps,
            if cf.scaling.by_head_dim {
                "1/√head_dim"
            } else {
                "1"
            },
            if cf.scaling.by_inverse_layer {
                " / (layer + 1)"
            } else {
                ""
            },
            if g.tied { "" } else { "un" },
        );
        // What the loader had to do (e.g. an untied head in a tied config), if anything.
        let note = match ck.note() {
            Some(n) => format!("{note}; {n}"),
            None => note,
        };
        Ok((ModelSpec::Gpt(g), note))
    }
}

impl Deref for ModelSpec {
    type Target = dyn Family;
    fn deref(&self) -> &(dyn Family + 'static) {
        self.family()
    }
}

impl DerefMut for ModelSpec {
    fn deref_mut(&mut self) -> &mut (dyn Family + 'static) {
        self.family_mut()
    }
}

impl From<GptConfig> for ModelSpec {
    fn from(g: GptConfig) -> ModelSpec {
        ModelSpec::Gpt(g)
    }
}

impl From<LlamaConfig> for ModelSpec {
    fn from(c: LlamaConfig) -> ModelSpec {
        ModelSpec::Llama(c)
    }
}
