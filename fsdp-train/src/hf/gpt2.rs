//! Hugging Face GPT-2 (`GPT2LMHeadModel`) in and out: `--init-from PATH` and `--export-hf DIR`.
//!
//! The layout is transformers' `GPT2LMHeadModel` as `save_pretrained` writes it: a
//! `model.safetensors` and a `config.json` side by side. Tensor names (the `transformer.` prefix
//! is optional on reading: the original GPT-2 upload has none):
//!
//! | ours (`nn::Gpt`) | Hugging Face | note |
//! |---|---|---|
//! | `tok_emb.weight` `[V, d]` | `transformer.wte.weight` `[V, d]` | |
//! | `pos_emb.weight` `[T, d]` | `transformer.wpe.weight` `[n_positions, d]` | `T ≤ n_positions`: the first `T` rows |
//! | `blocks.N.ln1.{weight,bias}` | `transformer.h.N.ln_1.{weight,bias}` | |
//! | `blocks.N.attn.qkv.weight` `[3d, d]` | `transformer.h.N.attn.c_attn.weight` `[d, 3d]` | Conv1D: transposed |
//! | `blocks.N.attn.proj.weight` `[d, d]` | `transformer.h.N.attn.c_proj.weight` `[d, d]` | transposed |
//! | `blocks.N.ln2.{weight,bias}` | `transformer.h.N.ln_2.{weight,bias}` | |
//! | `blocks.N.mlp.fc.weight` `[4d, d]` | `transformer.h.N.mlp.c_fc.weight` `[d, 4d]` | transposed |
//! | `blocks.N.mlp.proj.weight` `[d, 4d]` | `transformer.h.N.mlp.c_proj.weight` `[4d, d]` | transposed |
//! | `ln_f.{weight,bias}` | `transformer.ln_f.{weight,bias}` | |
//! | `head.weight` (untied only) | `lm_head.weight` | tied (GPT-2): not stored |
//!
//! Biases follow their weights untransposed. The attention's causal-mask buffers some files
//! carry (`attn.bias`, `attn.masked_bias`) are skipped; any other unknown tensor is refused.
//!
//! **Loading** ([`load_into`]) goes through fsdp-core's sharded loading path: each rank lists
//! its own pieces of every parameter ([`state_dict::sharded_state_dict`]), fills exactly those
//! elements from the memory-mapped file (transposing on the fly), and hands them to
//! [`state_dict::load_sharded_state_dict`]; no rank materializes the whole model. The file is
//! validated first — every expected tensor present, with its shape, in F32, F16 or BF16 — and a
//! problem is one [`HfError`] naming the first missing or mismatched tensor.
//!
//! **Exporting** ([`export`]) gathers a full state dict to rank 0 (a collective: every rank
//! calls it) and writes `model.safetensors` (F32, metadata `format = pt`, as transformers
//! expects) and `config.json` (`activation_function` `gelu_new` for the tanh GELU, `gelu` for the
//! exact one; `tie_word_embeddings` as the model has it).

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use super::{missing, write_model_dir, HfError, HfTensor, CONFIG, WEIGHTS};

use fsdp_autograd::nn::{Gelu, GptConfig, Module};
use fsdp_core::state_dict::{self, FullStateDict, ShardedStateDict};
use fsdp_core::Fsdp;
use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, TensorInfo};
use safetensors::SafeTensors;
use serde_json::{json, Value};

/// What a GPT-2 file must hold, as [`HfError::Missing`] says it.
const EXPECTED: &str = "a Hugging Face GPT2LMHeadModel file (transformer.wte, wpe, h.N.ln_1, \
                        attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj, ln_f)";

/// The shape and activation a Hugging Face GPT-2 `config.json` describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HfConfig {
    /// `vocab_size`.
    pub vocab: usize,
    /// `n_positions`.
    pub n_positions: usize,
    /// `n_embd`.
    pub d_model: usize,
    /// `n_layer`.
    pub n_layers: usize,
    /// `n_head`.
    pub n_heads: usize,
    /// `activation_function`: `gelu_new`/`gelu_pytorch_tanh` → tanh, `gelu` → exact.
    pub gelu: Gelu,
    /// `tie_word_embeddings` (true when absent, as in transformers).
    pub tied: bool,
}

impl HfConfig {
    /// The model config: these sizes, sequence length `n_positions`.
    pub fn gpt(&self) -> GptConfig {
        GptConfig::new(
            self.vocab,
            self.d_model,
            self.n_layers,
            self.n_heads,
            self.n_positions,
        )
        .with_tied(self.tied)
        .with_gelu(self.gelu)
    }

    /// Parses a `config.json` value (`path` names it in errors).
    pub fn from_json(path: &Path, v: &Value) -> Result<HfConfig, HfError> {
        let bad = |detail: String| HfError::Config {
            path: path.to_path_buf(),
            detail,
        };
        if let Some(t) = v.get("model_type").and_then(Value::as_str) {
            if t != "gpt2" {
                return Err(bad(format!(
                    "model_type is `{t}`, expected `gpt2` (a GPT2LMHeadModel config)"
                )));
            }
        }
        let size = |key: &str| -> Result<usize, HfError> {
            v.get(key)
                .and_then(Value::as_u64)
                .filter(|&n| n > 0 && n <= 1 << 24)
                .map(|n| n as usize)
                .ok_or_else(|| bad(format!("`{key}` is missing or not a positive integer")))
        };
        if let Some(inner) = v.get("n_inner").filter(|x| !x.is_null()) {
            let d = size("n_embd")?;
            if inner.as_u64() != Some(4 * d as u64) {
                return Err(bad(format!(
                    "n_inner {inner} is not 4·n_embd ({}): nn::Gpt's MLP is 4× wide",
                    4 * d
                )));
            }
        }
        let act = v
            .get("activation_function")
            .and_then(Value::as_str)
            .unwrap_or("gelu_new");
        let gelu = match act {
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Gelu::Tanh,
            "gelu" => Gelu::Exact,
            other => {
                return Err(bad(format!(
                    "activation_function `{other}` is not supported (gelu_new or gelu)"
                )))
            }
        };
        if let Some(eps) = v.get("layer_norm_epsilon").and_then(Value::as_f64) {
            if (eps - 1e-5).abs() > 1e-12 {
                return Err(bad(format!(
                    "layer_norm_epsilon {eps} is not 1e-5 (nn::Gpt's layer norms use 1e-5)"
                )));
            }
        }
        let c = HfConfig {
            vocab: size("vocab_size")?,
            n_positions: size("n_positions")?,
            d_model: size("n_embd")?,
            n_layers: size("n_layer")?,
            n_heads: size("n_head")?,
            gelu,
            tied: v
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(true),
        };
        if c.d_model % c.n_heads != 0 {
            return Err(bad(format!(
                "n_embd {} is not divisible by n_head {}",
                c.d_model, c.n_heads
            )));
        }
        Ok(c)
    }

    /// The `config.json` transformers' `GPT2LMHeadModel.from_pretrained` reads for `g`.
    pub fn to_json(g: &GptConfig) -> Value {
        json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": g.vocab,
            "n_positions": g.seq_len,
            "n_embd": g.d_model,
            "n_layer": g.n_layers,
            "n_head": g.n_heads,
            "n_inner": null,
            "activation_function": match g.gelu { Gelu::Tanh => "gelu_new", Gelu::Exact => "gelu" },
            "layer_norm_epsilon": 1e-5,
            "initializer_range": 0.02,
            "tie_word_embeddings": g.tied,
            "bos_token_id": 50256,
            "eos_token_id": 50256,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "scale_attn_weights": true,
            "torch_dtype": "float32",
        })
    }
}

/// How one of our parameters is stored in the Hugging Face file.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Source {
    /// The Hugging Face name (without the optional `transformer.` prefix for transformer parts).
    name: String,
    /// Conv1D: stored as the transpose of our `[out, in]`.
    transposed: bool,
}

/// The Hugging Face tensor behind our parameter `ours`, or `None` for a name `nn::Gpt` does not
/// have.
fn source(ours: &str) -> Option<Source> {
    let plain = |n: &str| Source {
        name: n.to_string(),
        transposed: false,
    };
    match ours {
        "tok_emb.weight" => return Some(plain("wte.weight")),
        "pos_emb.weight" => return Some(plain("wpe.weight")),
        "ln_f.weight" | "ln_f.bias" => return Some(plain(ours)),
        "head.weight" => return Some(plain("lm_head.weight")),
        _ => {}
    }
    let rest = ours.strip_prefix("blocks.")?;
    let (n, rest) = rest.split_once('.')?;
    n.parse::<usize>().ok()?;
    let (part, kind) = rest.rsplit_once('.')?;
    let hf = match part {
        "ln1" => "ln_1",
        "ln2" => "ln_2",
        "attn.qkv" => "attn.c_attn",
        "attn.proj" => "attn.c_proj",
        "mlp.fc" => "mlp.c_fc",
        "mlp.proj" => "mlp.c_proj",
        _ => return None,
    };
    Some(Source {
        name: format!("h.{n}.{hf}.{kind}"),
        transposed: kind == "weight" && !part.starts_with("ln"),
    })
}

/// Our parameters of a model of config `g`, in the model's order, with their shapes.
fn our_params(g: &GptConfig) -> Vec<(String, Vec<usize>)> {
    let d = g.d_model;
    let mut v = vec![
        ("tok_emb.weight".to_string(), vec![g.vocab, d]),
        ("pos_emb.weight".to_string(), vec![g.seq_len, d]),
    ];
    for i in 0..g.n_layers {
        let b = format!("blocks.{i}");
        v.push((format!("{b}.ln1.weight"), vec![d]));
        v.push((format!("{b}.ln1.bias"), vec![d]));
        v.push((format!("{b}.attn.qkv.weight"), vec![3 * d, d]));
        v.push((format!("{b}.attn.qkv.bias"), vec![3 * d]));
        v.push((format!("{b}.attn.proj.weight"), vec![d, d]));
        v.push((format!("{b}.attn.proj.bias"), vec![d]));
        v.push((format!("{b}.ln2.weight"), vec![d]));
        v.push((format!("{b}.ln2.bias"), vec![d]));
        v.push((format!("{b}.mlp.fc.weight"), vec![4 * d, d]));
        v.push((format!("{b}.mlp.fc.bias"), vec![4 * d]));
        v.push((format!("{b}.mlp.proj.weight"), vec![d, 4 * d]));
        v.push((format!("{b}.mlp.proj.bias"), vec![d]));
    }
    v.push(("ln_f.weight".to_string(), vec![d]));
    v.push(("ln_f.bias".to_string(), vec![d]));
    if !g.tied {
        v.push(("head.weight".to_string(), vec![g.vocab, d]));
    }
    v
}

/// The full name in a file with `prefix` (`transformer.` or empty): `lm_head` never has it.
fn full_name(prefix: &str, hf: &str) -> String {
    if hf.starts_with("lm_head") {
        hf.to_string()
    } else {
        format!("{prefix}{hf}")
    }
}

/// A memory-mapped Hugging Face GPT-2 checkpoint: its tensor table and configuration.
#[derive(Debug)]
pub struct HfCheckpoint {
    path: PathBuf,
    map: Mmap,
    /// Start of the data section in the file.
    data_start: usize,
    tensors: HashMap<String, TensorInfo>,
    /// `transformer.` or empty.
    prefix: String,
    /// The configuration (`config.json` beside the weights).
    pub config: HfConfig,
}

impl HfCheckpoint {
    /// Opens `path`: a directory holding `model.safetensors` and `config.json`, or the
    /// `.safetensors` file itself (with `config.json` beside it). Checks the tensor names first
    /// (so a file of another architecture is refused by its first missing tensor), then the
    /// configuration, then every tensor's shape and dtype.
    ///
    /// # Errors
    /// [`HfError`], naming the first problem.
    pub fn open(path: &Path) -> Result<HfCheckpoint, HfError> {
        let (file, dir) = if path.is_dir() {
            (path.join(WEIGHTS), path.to_path_buf())
        } else {
            (
                path.to_path_buf(),
                path.parent()
                    .map_or_else(|| PathBuf::from("."), Path::to_path_buf),
            )
        };
        let io = |p: &Path| {
            let p = p.to_path_buf();
            move |source| HfError::Io { path: p, source }
        };
        let f = File::open(&file).map_err(io(&file))?;
        // SAFETY: the map is read-only and private to this process; as every reader of a mapped
        // file, we rely on no other process truncating or rewriting the checkpoint while it is
        // read (a truncation would fault).
        let map = unsafe { Mmap::map(&f) }.map_err(io(&file))?;
        let (n, meta): (usize, Metadata) =
            SafeTensors::read_metadata(&map).map_err(|e| HfError::Format {
                path: file.clone(),
                detail: e.to_string(),
            })?;
        let tensors: HashMap<String, TensorInfo> = meta
            .tensors()
            .into_iter()
            .map(|(k, v)| (k, v.clone()))
            .collect();
        let prefix = if tensors.contains_key("transformer.wte.weight") {
            "transformer."
        } else if tensors.contains_key("wte.weight") {
            ""
        } else {
            return Err(missing(&file, &tensors, "transformer.wte.weight", EXPECTED));
        };
        let cfg_path = dir.join(CONFIG);
        let text = std::fs::read(&cfg_path).map_err(io(&cfg_path))?;
        let v: Value = serde_json::from_slice(&text).map_err(|e| HfError::Config {
            path: cfg_path.clone(),
            detail: format!("not JSON: {e}"),
        })?;
        let config = HfConfig::from_json(&cfg_path, &v)?;
        let ck = HfCheckpoint {
            path: file,
            map,
            data_start: 8 + n,
            tensors,
            prefix: prefix.to_string(),
            config,
        };
        ck.validate()?;
        Ok(ck)
    }

    /// The weights file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every expected tensor present with its shape and a float dtype; nothing unknown.
    fn validate(&self) -> Result<(), HfError> {
        let g = self.config.gpt();
        let mut expected = Vec::new();
        for (ours, shape) in our_params(&g) {
            let src = source(&ours).expect("our_params names only mapped parameters");
            let name = full_name(&self.prefix, &src.name);
            let want = match (src.transposed, shape.as_slice()) {
                (true, [r, c]) => vec![*c, *r],
                _ => shape,
            };
            let info = self
                .tensors
                .get(&name)
                .ok_or_else(|| missing(&self.path, &self.tensors, &name, EXPECTED))?;
            if info.shape != want {
                return Err(HfError::Shape {
                    path: self.path.clone(),
                    name,
                    got: info.shape.clone(),
                    want,
                });
            }
            if !matches!(info.dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
                return Err(HfError::Dtype {
                    path: self.path.clone(),
                    name,
                    dtype: format!("{:?}", info.dtype),
                });
            }
            expected.push(name);
        }
        let mut names: Vec<&String> = self.tensors.keys().collect();
        names.sort();
        for name in names {
            let skip = name.ends_with(".attn.bias")
                || name.ends_with(".attn.masked_bias")
                // A tied model's file may still carry the head (equal to wte).
                || (g.tied && name == "lm_head.weight");
            if !skip && !expected.contains(name) {
                return Err(HfError::Unexpected {
                    path: self.path.clone(),
                    arch: "GPT2LMHeadModel",
                    name: name.clone(),
                });
            }
        }
        Ok(())
    }

    /// Element `i` (row-major) of tensor `name` as f32.
    fn element(&self, info: &TensorInfo, i: usize) -> f32 {
        let at = self.data_start + info.data_offsets.0;
        match info.dtype {
            Dtype::F32 => {
                let b = &self.map[at + 4 * i..at + 4 * i + 4];
                f32::from_le_bytes([b[0], b[1], b[2], b[3]])
            }
            Dtype::F16 => {
                let b = &self.map[at + 2 * i..at + 2 * i + 2];
                half::f16::from_le_bytes([b[0], b[1]]).to_f32()
            }
            Dtype::BF16 => {
                let b = &self.map[at + 2 * i..at + 2 * i + 2];
                half::bf16::from_le_bytes([b[0], b[1]]).to_f32()
            }
            _ => unreachable!("validate admits only F32, F16 and BF16"),
        }
    }

    /// Elements `offset .. offset + out.len()` of our parameter `ours` (shape `shape`, row-major),
    /// read from the file: transposed for Conv1D weights; our rows past the file's (a larger
    /// `--vocab`) are zero; our `pos_emb` may have fewer rows than `n_positions`.
    fn read_piece(&self, ours: &str, shape: &[usize], offset: usize, out: &mut [f32]) {
        let src = source(ours).expect("validated names");
        let info = &self.tensors[&full_name(&self.prefix, &src.name)];
        let numel: usize = info.shape.iter().product();
        let cols = shape.get(1).copied().unwrap_or(1);
        let rows = shape.first().copied().unwrap_or(1);
        for (k, o) in out.iter_mut().enumerate() {
            let i = offset + k;
            let j = if src.transposed {
                let (r, c) = (i / cols, i % cols);
                c * rows + r
            } else {
                i
            };
            *o = if j < numel {
                self.element(info, j)
            } else {
                0.0
            };
        }
    }
}

impl HfCheckpoint {
    /// The whole model as a full state dict of the `nn::Gpt` of [`HfConfig::gpt`] (for a plain,
    /// unwrapped model: `train_gpt sample --init-from`).
    pub fn full_state_dict(&self) -> FullStateDict {
        let entries = our_params(&self.config.gpt())
            .into_iter()
            .map(|(name, shape)| {
                let mut values = vec![0.0f32; shape.iter().product()];
                self.read_piece(&name, &shape, 0, &mut values);
                fsdp_core::state_dict::TensorEntry {
                    name,
                    shape,
                    values,
                }
            })
            .collect();
        FullStateDict {
            world_size: 1,
            entries,
        }
    }
}

/// Checks that a model of config `g` can take `ck`'s weights: the same width, depth, heads,
/// tying and GELU; `vocab ≥` the file's (extra rows start at zero); `seq_len ≤ n_positions`.
pub fn check_model(ck: &HfCheckpoint, g: &GptConfig) -> Result<(), HfError> {
    let c = &ck.config;
    let bad = |detail: String| {
        Err(HfError::Model {
            path: ck.path.clone(),
            detail,
        })
    };
    if (g.d_model, g.n_layers, g.n_heads) != (c.d_model, c.n_layers, c.n_heads) {
        return bad(format!(
            "the model has d_model {} layers {} heads {}, the checkpoint {} {} {}",
            g.d_model, g.n_layers, g.n_heads, c.d_model, c.n_layers, c.n_heads
        ));
    }
    if g.tied != c.tied {
        return bad(format!(
            "the checkpoint's embedding and head are {}tied, the model's are {}",
            if c.tied { "" } else { "not " },
            if g.tied { "tied" } else { "not tied" }
        ));
    }
    if g.vocab < c.vocab {
        return bad(format!(
            "--vocab {} is smaller than the checkpoint's vocab_size {}",
            g.vocab, c.vocab
        ));
    }
    if g.seq_len > c.n_positions {
        return bad(format!(
            "--seq-len {} is longer than the checkpoint's n_positions {}",
            g.seq_len, c.n_positions
        ));
    }
    Ok(())
}

/// Loads `ck` into the wrapped model (an `nn::Gpt` of config `g`) through the sharded path: this
/// rank reads only the elements of its own pieces. Rank-local (no communication).
///
/// # Errors
/// [`HfError::Model`] when the model's shape does not fit; state-dict errors.
pub fn load_into<M: Module + 'static>(
    fsdp: &Fsdp<M>,
    ck: &HfCheckpoint,
    g: &GptConfig,
) -> Result<(), HfError> {
    check_model(ck, g)?;
    let sd_err = |context: &str| {
        let context = context.to_string();
        move |e| HfError::StateDict {
            context,
            source: Box::new(e),
        }
    };
    let mine =
        state_dict::sharded_state_dict(fsdp).map_err(sd_err("listing this rank's pieces"))?;
    let mut pieces = mine.pieces;
    for p in &mut pieces {
        if source(&p.name).is_none() {
            return Err(HfError::Model {
                path: ck.path.clone(),
                detail: format!("the model has a parameter `{}` GPT-2 does not", p.name),
            });
        }
        ck.read_piece(&p.name, &p.shape, p.offset, &mut p.values);
    }
    let dict = ShardedStateDict { pieces, ..mine };
    state_dict::load_sharded_state_dict(fsdp, &dict)
        .map_err(sd_err(&format!("loading {}", ck.path.display())))
}

/// Turns a full state dict of a `nn::Gpt` of config `g` into Hugging Face's tensors (name,
/// shape, f32 values), in the file's order.
fn to_hf(full: &FullStateDict, g: &GptConfig) -> Result<Vec<HfTensor>, String> {
    let mut out = Vec::new();
    for (ours, shape) in our_params(g) {
        let e = full
            .get(&ours)
            .ok_or_else(|| format!("the model has no parameter `{ours}`"))?;
        if e.shape != shape {
            return Err(format!(
                "`{ours}` has shape {:?}, expected {shape:?}",
                e.shape
            ));
        }
        let src = source(&ours).expect("our_params names only mapped parameters");
        let (shape, values) = match (src.transposed, shape.as_slice()) {
            (true, [r, c]) => {
                let (r, c) = (*r, *c);
                let mut t = vec![0.0f32; r * c];
                for i in 0..r {
                    for j in 0..c {
                        t[j * r + i] = e.values[i * c + j];
                    }
                }
                (vec![c, r], t)
            }
            _ => (shape, e.values.clone()),
        };
        out.push((full_name("transformer.", &src.name), shape, values));
    }
    Ok(out)
}

/// Writes `full` (of a model of config `g`) as a Hugging Face GPT-2 directory `dir`:
/// `model.safetensors` and `config.json`, each written to a temporary name and renamed.
///
/// # Errors
/// [`HfError::Io`], [`HfError::Format`], [`HfError::Model`].
pub fn write_dir(full: &FullStateDict, g: &GptConfig, dir: &Path) -> Result<(), HfError> {
    let tensors = to_hf(full, g).map_err(|detail| HfError::Model {
        path: dir.to_path_buf(),
        detail,
    })?;
    let config = HfConfig::to_json(g);
    write_model_dir(dir, tensors, &config)
}

/// `--export-hf DIR`: gathers the parameters of the wrapped `nn::Gpt` of config `g` to rank 0
/// and writes them there (a collective: every rank calls it; only rank 0 of the shard group
/// writes).
///
/// # Errors
/// State-dict errors of the gather; [`write_dir`]'s on the writing rank.
pub fn export<M: Module + 'static>(
    fsdp: &Fsdp<M>,
    g: &GptConfig,
    dir: &Path,
) -> Result<(), HfError> {
    let full = state_dict::full_state_dict(fsdp, true).map_err(|e| HfError::StateDict {
        context: format!("--export-hf {}: gathering the parameters", dir.display()),
        source: Box::new(e),
    })?;
    if full.is_empty() {
        return Ok(());
    }
    write_dir(&full, g, dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;
    use std::sync::Arc;

    use fsdp_alloc::Device;
    use fsdp_autograd::nn::Gpt;
    use fsdp_autograd::{InitContext, Tensor};
    use fsdp_collectives::{ProcessGroup, ThreadGroup};
    use fsdp_core::{FsdpConfig, WrapPolicy};

    fn fixture() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpt2-tiny")
    }

    /// Runs `f(device, fsdp)` on `world` thread ranks, each wrapping a fresh (seed 99) `nn::Gpt`
    /// of `g` with one unit per block.
    fn on_ranks<T: Send + 'static>(
        world: usize,
        g: GptConfig,
        f: impl Fn(&Device, &Fsdp<Gpt>) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let f = Arc::new(f);
        let hs: Vec<_> = ThreadGroup::new(world)
            .into_iter()
            .enumerate()
            .map(|(r, pg)| {
                let f = Arc::clone(&f);
                std::thread::spawn(move || {
                    let dev = Device::cpu(r);
                    let model = Gpt::new(&InitContext::eager(&dev, 99), &g).unwrap();
                    let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
                    let cfg = FsdpConfig {
                        wrap_policy: WrapPolicy::ModuleTypes(vec!["Block".into()]),
                        ..FsdpConfig::default()
                    };
                    let fsdp = Fsdp::wrap(model, &dev, pg, cfg).unwrap();
                    f(&dev, &fsdp)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    }

    fn logits(dev: &Device, fsdp: &Fsdp<Gpt>, tokens: &[i64]) -> Vec<f32> {
        let ids = Tensor::from_vec(tokens.to_vec(), &[1, tokens.len()], dev).unwrap();
        fsdp_autograd::no_grad(|| fsdp.forward(&ids))
            .unwrap()
            .to_vec::<f32>()
            .unwrap()
    }

    #[test]
    fn names_map_both_ways() {
        let g = GptConfig::new(10, 8, 2, 2, 4);
        let names: Vec<_> = our_params(&g)
            .iter()
            .map(|(n, _)| source(n).unwrap().name)
            .collect();
        assert!(names.contains(&"h.1.attn.c_attn.weight".to_string()));
        assert_eq!(
            source("blocks.0.mlp.proj.weight"),
            Some(Source {
                name: "h.0.mlp.c_proj.weight".into(),
                transposed: true
            })
        );
        assert!(!source("blocks.0.mlp.proj.bias").unwrap().transposed);
        assert!(!source("blocks.3.ln2.weight").unwrap().transposed);
        assert_eq!(source("blocks.x.ln1.weight"), None);
        // The wrapped model names its parameters exactly like our_params.
        let dev = Device::cpu(0);
        let m = Gpt::new(&InitContext::eager(&dev, 0), &g.with_tied(true)).unwrap();
        let mine: Vec<String> = fsdp_autograd::nn::named_parameters(&m)
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        let want: Vec<String> = our_params(&g.with_tied(true))
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(mine, want);
    }

    /// The fixture's logits (transformers, float32) against ours after loading through
    /// `--init-from`'s code on 2 ranks, for both GELUs: every position's logits of every 97th id
    /// within 1e-5 of the position's largest |logit|, and the full-vocab log-sum-exp within 1e-5
    /// relative.
    #[test]
    fn fixture_logits_match_transformers() {
        let text = std::fs::read_to_string(fixture().join("logits.json")).unwrap();
        let want: Value = serde_json::from_str(&text).unwrap();
        let tokens: Vec<i64> = want["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_i64().unwrap())
            .collect();
        let ids: Vec<usize> = want["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as usize)
            .collect();
        let ck = HfCheckpoint::open(&fixture()).unwrap();
        assert_eq!(
            ck.config.gelu,
            Gelu::Tanh,
            "the fixture's config names gelu_new"
        );
        for (act, gelu) in [("gelu_new", Gelu::Tanh), ("gelu", Gelu::Exact)] {
            let g = ck.config.gpt().with_gelu(gelu);
            let toks = tokens.clone();
            let got = on_ranks(2, g, move |dev, fsdp| {
                let ck = HfCheckpoint::open(&fixture()).unwrap();
                load_into(fsdp, &ck, &fsdp.module().config).unwrap();
                logits(dev, fsdp, &toks)
            });
            assert_eq!(got[0], got[1], "ranks agree");
            let got = &got[0];
            let v = g.vocab;
            let w = &want["activations"][act];
            for (t, row) in w["logits"].as_array().unwrap().iter().enumerate() {
                let row: Vec<f64> = row
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap())
                    .collect();
                let scale = row.iter().fold(0.0f64, |m, x| m.max(x.abs()));
                let mine = &got[t * v..(t + 1) * v];
                for (k, &id) in ids.iter().enumerate() {
                    let err = (mine[id] as f64 - row[k]).abs() / scale;
                    assert!(
                        err <= 1e-5,
                        "{act}: position {t} id {id}: {} vs {} (rel {err:e})",
                        mine[id],
                        row[k]
                    );
                }
                let m = mine.iter().fold(f64::MIN, |m, &x| m.max(x as f64));
                let lse = m + mine.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
                let want_lse = w["logsumexp"][t].as_f64().unwrap();
                assert!(
                    ((lse - want_lse) / want_lse).abs() <= 1e-5,
                    "{act}: position {t}: logsumexp {lse} vs {want_lse}"
                );
            }
        }
    }

    /// The wrong GELU is caught: the fixture's tanh logits do not match an exact-GELU model.
    #[test]
    fn the_gelu_variant_shows_in_the_logits() {
        let ck = HfCheckpoint::open(&fixture()).unwrap();
        let g = ck.config.gpt();
        let toks: Vec<i64> = vec![464, 2068, 7586, 21831];
        let run = move |gelu| {
            on_ranks(1, g.with_gelu(gelu), {
                let toks = toks.clone();
                move |dev, fsdp| {
                    load_into(fsdp, &HfCheckpoint::open(&fixture()).unwrap(), &g).unwrap();
                    logits(dev, fsdp, &toks)
                }
            })
            .remove(0)
        };
        let (a, b) = (run(Gelu::Tanh), run(Gelu::Exact));
        let scale = a.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let diff = a
            .iter()
            .zip(&b)
            .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(diff / scale > 1e-5, "{diff} / {scale}");
    }

    /// Export → import is bit for bit: the exported file holds exactly the fixture's tensors,
    /// and a model loaded from the export equals the one loaded from the fixture.
    #[test]
    fn export_import_round_trip_is_bitwise() {
        let out = tempfile::tempdir().unwrap();
        let dir = out.path().join("hf");
        let g = HfCheckpoint::open(&fixture()).unwrap().config.gpt();
        let d2 = dir.clone();
        let first = on_ranks(2, g, move |_, fsdp| {
            load_into(fsdp, &HfCheckpoint::open(&fixture()).unwrap(), &g).unwrap();
            export(fsdp, &g, &d2).unwrap();
            state_dict::full_state_dict(fsdp, false).unwrap()
        });
        let orig = std::fs::read(fixture().join(WEIGHTS)).unwrap();
        let orig = SafeTensors::deserialize(&orig).unwrap();
        let new = std::fs::read(dir.join(WEIGHTS)).unwrap();
        let new = SafeTensors::deserialize(&new).unwrap();
        let mut names = orig.names();
        names.sort();
        let mut new_names = new.names();
        new_names.sort();
        assert_eq!(names, new_names);
        for n in names {
            let (a, b) = (orig.tensor(n).unwrap(), new.tensor(n).unwrap());
            assert_eq!((a.shape(), a.dtype()), (b.shape(), b.dtype()), "{n}");
            assert!(a.data() == b.data(), "{n} differs");
        }
        let cfg = HfCheckpoint::open(&dir).unwrap().config;
        assert_eq!(cfg, HfCheckpoint::open(&fixture()).unwrap().config);
        let d3 = dir.clone();
        let second = on_ranks(3, g, move |_, fsdp| {
            load_into(fsdp, &HfCheckpoint::open(&d3).unwrap(), &g).unwrap();
            state_dict::full_state_dict(fsdp, false).unwrap()
        });
        for (a, b) in first[0].entries.iter().zip(&second[0].entries) {
            assert_eq!(a.name, b.name);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a.values), bits(&b.values), "{}", a.name);
        }
    }

    #[test]
    fn other_files_are_refused_by_their_first_missing_or_wrong_tensor() {
        let tmp = tempfile::tempdir().unwrap();
        // A Llama-like file: no GPT-2 names.
        let llama = tmp.path().join("llama.safetensors");
        let data = vec![0u8; 16];
        let v = TensorView::new(Dtype::F32, vec![2, 2], &data).unwrap();
        safetensors::serialize_to_file(vec![("model.embed_tokens.weight", v)], None, &llama)
            .unwrap();
        let e = HfCheckpoint::open(&llama).unwrap_err().to_string();
        assert!(e.contains("no tensor `transformer.wte.weight`"), "{e}");
        assert!(e.contains("model.embed_tokens.weight"), "{e}");
        assert!(!e.contains('\n'));

        // The fixture's config with a wrong-shaped c_fc.
        let bad = tmp.path().join("bad");
        std::fs::create_dir(&bad).unwrap();
        std::fs::copy(fixture().join(CONFIG), bad.join(CONFIG)).unwrap();
        let orig = std::fs::read(fixture().join(WEIGHTS)).unwrap();
        let st = SafeTensors::deserialize(&orig).unwrap();
        let mut keep: Vec<(String, TensorView<'_>)> = st
            .tensors()
            .into_iter()
            .filter(|(n, _)| n != "transformer.h.1.mlp.c_fc.weight")
            .collect();
        let small = vec![0u8; 64 * 4];
        keep.push((
            "transformer.h.1.mlp.c_fc.weight".into(),
            TensorView::new(Dtype::F32, vec![64, 1], &small).unwrap(),
        ));
        safetensors::serialize_to_file(keep, None, &bad.join(WEIGHTS)).unwrap();
        let e = HfCheckpoint::open(&bad).unwrap_err();
        assert!(
            matches!(&e, HfError::Shape { name, .. } if name == "transformer.h.1.mlp.c_fc.weight"),
            "{e}"
        );

        // A config of another architecture.
        let other = tmp.path().join("other");
        std::fs::create_dir(&other).unwrap();
        std::fs::copy(fixture().join(WEIGHTS), other.join(WEIGHTS)).unwrap();
        std::fs::write(other.join(CONFIG), r#"{"model_type": "llama"}"#).unwrap();
        let e = HfCheckpoint::open(&other).unwrap_err().to_string();
        assert!(e.contains("model_type is `llama`"), "{e}");
    }
}
