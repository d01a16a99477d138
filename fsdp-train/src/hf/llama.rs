//! Hugging Face Llama (`LlamaForCausalLM`) in and out: `--init-from PATH` and `--export-hf DIR`.
//!
//! The layout is transformers' `LlamaForCausalLM` as `save_pretrained` writes it: `config.json`
//! beside one `model.safetensors` or the shards a `model.safetensors.index.json` names; F32, F16
//! or BF16 tensors. `nn::Llama` uses transformers' module names without the `model.` prefix, so
//! the map is one line: ours `X` is theirs `model.X`, except `lm_head.weight` (stored only when
//! the head is untied; a tied file may still carry it, equal to the embedding, and it is then
//! skipped). No tensor is transposed. The rotary buffers older files carry
//! (`model.layers.N.self_attn.rotary_emb.inv_freq`) are skipped (the tables are computed from the
//! configuration); any other unknown tensor is refused.
//!
//! `config.json` keys are on an allow-list ([`ALLOWED`]): every key is either used, checked to
//! have the one value `nn::Llama` implements (`hidden_act` `silu`, no biases, no dropout, head
//! dim = width / heads, RoPE `default` or `llama3`), or metadata without effect on the model
//! (token ids, dtype, versions, init range); any other key is refused by name, so a
//! configuration this code does not understand is never silently trained as a different model.
//! Both RoPE spellings are read: transformers 4's `rope_theta` + `rope_scaling`, and 5's
//! `rope_parameters`; the export writes the former (read by both).
//!
//! **Loading** ([`load_into`]) goes through fsdp-core's sharded path like GPT-2's: each rank
//! fills only the elements of its own pieces from the memory-mapped files. **Exporting**
//! ([`export`]) gathers a full state dict to rank 0 and writes `model.safetensors` (F32) and
//! `config.json`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use fsdp_autograd::nn::{Llama3Scaling, LlamaConfig, Module};
use fsdp_core::state_dict::{self, FullStateDict, ShardedStateDict, TensorEntry};
use fsdp_core::Fsdp;
use safetensors::tensor::Dtype;
use serde_json::{json, Map, Value};

use super::tensors::TensorFiles;
use super::{missing, write_model_dir, HfError, HfTensor, CONFIG};

/// What a Llama file must hold, as [`HfError::Missing`] says it.
const EXPECTED: &str = "a Hugging Face LlamaForCausalLM file (model.embed_tokens, \
                        model.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, \
                        post_attention_layernorm, mlp.{gate,up,down}_proj}, model.norm, lm_head)";

/// The longest default sequence length taken from `max_position_embeddings` (Llama 3's 131,072
/// is a context limit, not a training length); `--seq-len` may go up to the file's limit.
pub const DEFAULT_SEQ_CAP: usize = 2048;

/// The `config.json` keys a Llama may have: used, checked, or metadata without effect.
pub const ALLOWED: &[&str] = &[
    // Used.
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "tie_word_embeddings",
    // Checked against what nn::Llama implements.
    "model_type",
    "architectures",
    "hidden_act",
    "head_dim",
    "attention_bias",
    "mlp_bias",
    "attention_dropout",
    "rope_interleaved",
    // Metadata: no effect on the model's function.
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
    "use_cache",
    "pretraining_tp",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "_name_or_path",
    "is_llama_config",
];

/// A Llama `config.json`: the model and the file's position limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlamaHfConfig {
    /// The model (`seq_len` = the positions, at most [`DEFAULT_SEQ_CAP`]).
    pub model: LlamaConfig,
    /// `max_position_embeddings`.
    pub max_positions: usize,
}

impl LlamaHfConfig {
    /// Parses a `config.json` value (`path` names it in errors).
    ///
    /// # Errors
    /// [`HfError::Config`] naming the key: unknown, missing, of the wrong type, or of a value
    /// `nn::Llama` does not implement.
    pub fn from_json(path: &Path, v: &Value) -> Result<LlamaHfConfig, HfError> {
        let bad = |detail: String| HfError::Config {
            path: path.to_path_buf(),
            detail,
        };
        let obj = v
            .as_object()
            .ok_or_else(|| bad("config.json is not a JSON object".into()))?;
        if let Some(k) = obj.keys().find(|k| !ALLOWED.contains(&k.as_str())) {
            return Err(bad(format!(
                "unknown key `{k}`: a LlamaForCausalLM config.json is read only when every key \
                 is one this loader knows (fsdp-train/src/hf/llama.rs ALLOWED); remove the key \
                 if it does not change the model"
            )));
        }
        match obj.get("model_type").and_then(Value::as_str) {
            Some("llama") | None => {}
            Some(t) => return Err(bad(format!("model_type is `{t}`, expected `llama`"))),
        }
        if let Some(a) = obj.get("architectures").and_then(Value::as_array) {
            if !a.iter().any(|x| x.as_str() == Some("LlamaForCausalLM")) {
                return Err(bad(format!(
                    "architectures {} does not name LlamaForCausalLM",
                    Value::Array(a.clone())
                )));
            }
        }
        let size = |key: &str| -> Result<usize, HfError> {
            obj.get(key)
                .and_then(Value::as_u64)
                .filter(|&n| n > 0 && n <= 1 << 24)
                .map(|n| n as usize)
                .ok_or_else(|| bad(format!("`{key}` is missing or not a positive integer")))
        };
        let flag = |key: &str, want: bool| -> Result<(), HfError> {
            match obj.get(key) {
                None | Some(Value::Null) => Ok(()),
                Some(Value::Bool(b)) if *b == want => Ok(()),
                Some(x) => Err(bad(format!(
                    "`{key}` is {x}; nn::Llama implements only {want} (no biases, \
                     rotate-half RoPE)"
                ))),
            }
        };
        flag("attention_bias", false)?;
        flag("mlp_bias", false)?;
        flag("rope_interleaved", false)?;
        match obj.get("hidden_act").and_then(Value::as_str) {
            None | Some("silu") | Some("swish") => {}
            Some(a) => {
                return Err(bad(format!(
                    "hidden_act `{a}` is not supported (nn::Llama's MLP is SwiGLU: silu)"
                )))
            }
        }
        if let Some(p) = obj.get("attention_dropout").filter(|x| !x.is_null()) {
            if p.as_f64() != Some(0.0) {
                return Err(bad(format!(
                    "attention_dropout is {p}; nn::Llama has no dropout (0 is supported)"
                )));
            }
        }
        let (vocab, d, layers, heads) = (
            size("vocab_size")?,
            size("hidden_size")?,
            size("num_hidden_layers")?,
            size("num_attention_heads")?,
        );
        let kv = match obj.get("num_key_value_heads") {
            None | Some(Value::Null) => heads,
            Some(_) => size("num_key_value_heads")?,
        };
        let ffn = size("intermediate_size")?;
        let max_positions = size("max_position_embeddings")?;
        if d % heads != 0 {
            return Err(bad(format!(
                "hidden_size {d} is not divisible by num_attention_heads {heads}"
            )));
        }
        if let Some(hd) = obj.get("head_dim").filter(|x| !x.is_null()) {
            if hd.as_u64() != Some((d / heads) as u64) {
                return Err(bad(format!(
                    "head_dim {hd} is not hidden_size / num_attention_heads = {}; nn::Llama's \
                     heads are d_model / n_heads wide",
                    d / heads
                )));
            }
        }
        let eps = match obj.get("rms_norm_eps") {
            None => 1e-6,
            Some(x) => x
                .as_f64()
                .filter(|e| e.is_finite() && *e >= 0.0)
                .ok_or_else(|| bad(format!("`rms_norm_eps` is {x}, not a number >= 0")))?,
        };
        let tied = match obj.get("tie_word_embeddings") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(x) => return Err(bad(format!("`tie_word_embeddings` is {x}, not a bool"))),
        };
        let (theta, scaling) = rope(obj, max_positions).map_err(bad)?;
        let model = LlamaConfig::new(
            vocab,
            d,
            layers,
            heads,
            kv,
            ffn,
            max_positions.min(DEFAULT_SEQ_CAP),
        )
        .with_rope_theta(theta)
        .with_rope_scaling(scaling)
        .with_rms_eps(eps)
        .with_tied(tied);
        model.validate().map_err(|e| bad(e.to_string()))?;
        Ok(LlamaHfConfig {
            model,
            max_positions,
        })
    }

    /// The `config.json` transformers' `LlamaForCausalLM.from_pretrained` reads for `c`
    /// (`max_position_embeddings` = `c.seq_len`; RoPE in transformers 4's spelling, which 5
    /// reads too).
    pub fn to_json(c: &LlamaConfig) -> Value {
        let scaling = match c.rope_scaling {
            None => Value::Null,
            Some(s) => json!({
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position,
            }),
        };
        json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": c.vocab,
            "hidden_size": c.d_model,
            "intermediate_size": c.ffn_dim,
            "num_hidden_layers": c.n_layers,
            "num_attention_heads": c.n_heads,
            "num_key_value_heads": c.n_kv_heads,
            "head_dim": c.head_dim(),
            "hidden_act": "silu",
            "max_position_embeddings": c.seq_len,
            "rms_norm_eps": c.rms_eps,
            "rope_theta": c.rope_theta,
            "rope_scaling": scaling,
            "tie_word_embeddings": c.tied,
            "attention_bias": false,
            "mlp_bias": false,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "torch_dtype": "float32",
        })
    }
}

/// θ and the scaling from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`
/// (4): `default` or `llama3`; anything else is refused naming the key.
fn rope(
    obj: &Map<String, Value>,
    max_positions: usize,
) -> Result<(f64, Option<Llama3Scaling>), String> {
    let params = obj.get("rope_parameters").filter(|x| !x.is_null());
    let scaling = obj.get("rope_scaling").filter(|x| !x.is_null());
    let (key, p) = match (params, scaling) {
        (Some(_), Some(_)) => {
            return Err("both `rope_parameters` and `rope_scaling` are set; keep one".into())
        }
        (Some(p), None) => ("rope_parameters", Some(p)),
        (None, Some(s)) => ("rope_scaling", Some(s)),
        (None, None) => ("rope_scaling", None),
    };
    let p = match p {
        None => None,
        Some(Value::Object(m)) => Some(m),
        Some(x) => return Err(format!("`{key}` is {x}, not an object")),
    };
    let num = |m: &Map<String, Value>, k: &str| -> Result<Option<f64>, String> {
        match m.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_f64()
                .filter(|v| v.is_finite())
                .map(Some)
                .ok_or_else(|| format!("`{key}.{k}` is {x}, not a number")),
        }
    };
    let top_theta = match obj.get("rope_theta") {
        None | Some(Value::Null) => None,
        Some(x) => Some(
            x.as_f64()
                .filter(|v| v.is_finite())
                .ok_or_else(|| format!("`rope_theta` is {x}, not a number"))?,
        ),
    };
    let theta = match &p {
        Some(m) => num(m, "rope_theta")?.or(top_theta),
        None => top_theta,
    }
    .unwrap_or(10_000.0);
    let Some(m) = p else {
        return Ok((theta, None));
    };
    const KNOWN: &[&str] = &[
        "rope_type",
        "type",
        "rope_theta",
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ];
    if let Some(k) = m.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        return Err(format!(
            "`{key}.{k}` is not a key of the RoPE types nn::Llama implements (default, llama3)"
        ));
    }
    let ty = m
        .get("rope_type")
        .or_else(|| m.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    match ty {
        "default" => {
            if let Some(k) = ["factor", "low_freq_factor", "high_freq_factor"]
                .iter()
                .find(|k| m.contains_key(**k))
            {
                return Err(format!("`{key}.{k}` is set for the default RoPE type"));
            }
            Ok((theta, None))
        }
        "llama3" => {
            let need = |k: &str| -> Result<f64, String> {
                num(m, k)?.ok_or_else(|| format!("`{key}.{k}` is missing (rope_type llama3)"))
            };
            let orig = match num(m, "original_max_position_embeddings")? {
                Some(v) if v >= 1.0 && v.fract() == 0.0 => v as usize,
                Some(v) => {
                    return Err(format!(
                        "`{key}.original_max_position_embeddings` is {v}, not a positive integer"
                    ))
                }
                None => max_positions,
            };
            Ok((
                theta,
                Some(Llama3Scaling {
                    factor: need("factor")?,
                    low_freq_factor: need("low_freq_factor")?,
                    high_freq_factor: need("high_freq_factor")?,
                    original_max_position: orig,
                }),
            ))
        }
        other => Err(format!(
            "`{key}.rope_type` is `{other}`; nn::Llama implements `default` and `llama3` RoPE"
        )),
    }
}

/// The Hugging Face name of our parameter `ours`.
fn hf_name(ours: &str) -> String {
    if ours == "lm_head.weight" {
        ours.to_string()
    } else {
        format!("model.{ours}")
    }
}

/// Our parameters of a model of config `c`, in the model's order, with their shapes.
pub fn our_params(c: &LlamaConfig) -> Vec<(String, Vec<usize>)> {
    let (d, f) = (c.d_model, c.ffn_dim);
    let kv = c.n_kv_heads * c.head_dim();
    let mut v = vec![("embed_tokens.weight".to_string(), vec![c.vocab, d])];
    for i in 0..c.n_layers {
        let l = format!("layers.{i}");
        v.push((format!("{l}.input_layernorm.weight"), vec![d]));
        v.push((format!("{l}.self_attn.q_proj.weight"), vec![d, d]));
        v.push((format!("{l}.self_attn.k_proj.weight"), vec![kv, d]));
        v.push((format!("{l}.self_attn.v_proj.weight"), vec![kv, d]));
        v.push((format!("{l}.self_attn.o_proj.weight"), vec![d, d]));
        v.push((format!("{l}.post_attention_layernorm.weight"), vec![d]));
        v.push((format!("{l}.mlp.gate_proj.weight"), vec![f, d]));
        v.push((format!("{l}.mlp.up_proj.weight"), vec![f, d]));
        v.push((format!("{l}.mlp.down_proj.weight"), vec![d, f]));
    }
    v.push(("norm.weight".to_string(), vec![d]));
    if !c.tied {
        v.push(("lm_head.weight".to_string(), vec![c.vocab, d]));
    }
    v
}

/// A memory-mapped Hugging Face Llama checkpoint: its tensors and configuration.
#[derive(Debug)]
pub struct LlamaCheckpoint {
    files: TensorFiles,
    /// The configuration (`config.json` beside the weights).
    pub config: LlamaHfConfig,
}

impl LlamaCheckpoint {
    /// Opens `path` (a directory, its `model.safetensors`, or its index) and its
    /// `config.json`; checks the configuration, then every expected tensor (present, shape, a
    /// float dtype) and that nothing else is stored.
    ///
    /// # Errors
    /// [`HfError`], naming the first problem.
    pub fn open(path: &Path) -> Result<LlamaCheckpoint, HfError> {
        let files = TensorFiles::open(path)?;
        let dir = files
            .path
            .parent()
            .map_or_else(|| PathBuf::from("."), Path::to_path_buf);
        let cfg_path = dir.join(CONFIG);
        let text = std::fs::read(&cfg_path).map_err(|source| HfError::Io {
            path: cfg_path.clone(),
            source,
        })?;
        let v: Value = serde_json::from_slice(&text).map_err(|e| HfError::Config {
            path: cfg_path.clone(),
            detail: format!("not JSON: {e}"),
        })?;
        let config = LlamaHfConfig::from_json(&cfg_path, &v)?;
        let ck = LlamaCheckpoint { files, config };
        ck.validate()?;
        Ok(ck)
    }

    /// The weights file (or the index of a sharded checkpoint).
    pub fn path(&self) -> &Path {
        &self.files.path
    }

    fn validate(&self) -> Result<(), HfError> {
        let c = &self.config.model;
        let path = self.files.path.clone();
        let mut expected = Vec::new();
        for (ours, want) in our_params(c) {
            let name = hf_name(&ours);
            let e = self
                .files
                .tensors
                .get(&name)
                .ok_or_else(|| missing(&path, &self.files.infos(), &name, EXPECTED))?;
            if e.info.shape != want {
                return Err(HfError::Shape {
                    path: self.files.file_of(e).to_path_buf(),
                    name,
                    got: e.info.shape.clone(),
                    want,
                });
            }
            if !matches!(e.info.dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
                return Err(HfError::Dtype {
                    path: self.files.file_of(e).to_path_buf(),
                    name,
                    dtype: format!("{:?}", e.info.dtype),
                });
            }
            expected.push(name);
        }
        for name in self.files.names() {
            let skip =
                name.ends_with(".rotary_emb.inv_freq") || (c.tied && name == "lm_head.weight");
            if !skip && !expected.contains(name) {
                return Err(HfError::Unexpected {
                    path: path.clone(),
                    arch: "LlamaForCausalLM",
                    name: name.clone(),
                });
            }
        }
        Ok(())
    }

    /// Elements `offset .. offset + out.len()` of our parameter `ours` (shape `shape`,
    /// row-major): rows past the file's (a larger `--vocab`) are zero.
    fn read_piece(&self, ours: &str, offset: usize, out: &mut [f32]) {
        let e = &self.files.tensors[&hf_name(ours)];
        let numel: usize = e.info.shape.iter().product();
        let have = numel.saturating_sub(offset).min(out.len());
        self.files.read(e, offset, &mut out[..have]);
        out[have..].fill(0.0);
    }

    /// The whole model as a full state dict of the `nn::Llama` of `c` (for a plain, unwrapped
    /// model: `train_gpt sample --init-from`).
    pub fn full_state_dict(&self, c: &LlamaConfig) -> FullStateDict {
        let entries = our_params(c)
            .into_iter()
            .map(|(name, shape)| {
                let mut values = vec![0.0f32; shape.iter().product()];
                self.read_piece(&name, 0, &mut values);
                TensorEntry {
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

/// Checks that a model of config `c` can take `ck`'s weights: the same width, depth, heads,
/// key/value heads, feed-forward width, tying, RoPE and eps; `vocab ≥` the file's (extra rows
/// start at zero); `seq_len ≤ max_position_embeddings`.
///
/// # Errors
/// [`HfError::Model`] naming the difference.
pub fn check_model(ck: &LlamaCheckpoint, c: &LlamaConfig) -> Result<(), HfError> {
    let f = &ck.config.model;
    let bad = |detail: String| {
        Err(HfError::Model {
            path: ck.path().to_path_buf(),
            detail,
        })
    };
    let shape = |m: &LlamaConfig| (m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim);
    if shape(c) != shape(f) {
        return bad(format!(
            "the model has (d_model, layers, heads, kv heads, ffn) {:?}, the checkpoint {:?}",
            shape(c),
            shape(f)
        ));
    }
    if c.tied != f.tied {
        return bad(format!(
            "the checkpoint's embedding and head are {}tied, the model's are {}",
            if f.tied { "" } else { "not " },
            if c.tied { "tied" } else { "not tied" }
        ));
    }
    if (c.rope_theta, c.rope_scaling, c.rms_eps) != (f.rope_theta, f.rope_scaling, f.rms_eps) {
        return bad("the model's RoPE or RMSNorm eps differs from config.json's".into());
    }
    if c.vocab < f.vocab {
        return bad(format!(
            "--vocab {} is smaller than the checkpoint's vocab_size {}",
            c.vocab, f.vocab
        ));
    }
    if c.seq_len > ck.config.max_positions {
        return bad(format!(
            "--seq-len {} is longer than the checkpoint's max_position_embeddings {}",
            c.seq_len, ck.config.max_positions
        ));
    }
    Ok(())
}

/// Loads `ck` into the wrapped `nn::Llama` of config `c` through the sharded path: this rank
/// reads only the elements of its own pieces. Rank-local (no communication).
///
/// # Errors
/// [`HfError::Model`] when the model does not fit; state-dict errors.
pub fn load_into<M: Module + 'static>(
    fsdp: &Fsdp<M>,
    ck: &LlamaCheckpoint,
    c: &LlamaConfig,
) -> Result<(), HfError> {
    check_model(ck, c)?;
    let sd_err = |context: &str| {
        let context = context.to_string();
        move |e| HfError::StateDict {
            context,
            source: Box::new(e),
        }
    };
    let mine =
        state_dict::sharded_state_dict(fsdp).map_err(sd_err("listing this rank's pieces"))?;
    let known: HashMap<String, Vec<usize>> = our_params(c).into_iter().collect();
    let mut pieces = mine.pieces;
    for p in &mut pieces {
        if known.get(&p.name) != Some(&p.shape) {
            return Err(HfError::Model {
                path: ck.path().to_path_buf(),
                detail: format!(
                    "the model has a parameter `{}` {:?} Llama's layout does not",
                    p.name, p.shape
                ),
            });
        }
        ck.read_piece(&p.name, p.offset, &mut p.values);
    }
    let dict = ShardedStateDict { pieces, ..mine };
    state_dict::load_sharded_state_dict(fsdp, &dict)
        .map_err(sd_err(&format!("loading {}", ck.path().display())))
}

/// Writes `full` (of an `nn::Llama` of config `c`) as a Hugging Face Llama directory `dir`:
/// `model.safetensors` (F32) and `config.json`, each written to a temporary name and renamed.
///
/// # Errors
/// [`HfError::Io`], [`HfError::Format`], [`HfError::Model`].
pub fn write_dir(full: &FullStateDict, c: &LlamaConfig, dir: &Path) -> Result<(), HfError> {
    let mut tensors: Vec<HfTensor> = Vec::new();
    for (ours, shape) in our_params(c) {
        let e = full.get(&ours).ok_or_else(|| HfError::Model {
            path: dir.to_path_buf(),
            detail: format!("the model has no parameter `{ours}`"),
        })?;
        if e.shape != shape {
            return Err(HfError::Model {
                path: dir.to_path_buf(),
                detail: format!("`{ours}` has shape {:?}, expected {shape:?}", e.shape),
            });
        }
        tensors.push((hf_name(&ours), shape, e.values.clone()));
    }
    write_model_dir(dir, tensors, &LlamaHfConfig::to_json(c))
}

/// `--export-hf DIR`: gathers the wrapped `nn::Llama`'s parameters to rank 0 and writes them
/// there (a collective: every rank calls it; only rank 0 of the shard group writes).
///
/// # Errors
/// State-dict errors of the gather; [`write_dir`]'s on the writing rank.
pub fn export<M: Module + 'static>(
    fsdp: &Fsdp<M>,
    c: &LlamaConfig,
    dir: &Path,
) -> Result<(), HfError> {
    let full = state_dict::full_state_dict(fsdp, true).map_err(|e| HfError::StateDict {
        context: format!("--export-hf {}: gathering the parameters", dir.display()),
        source: Box::new(e),
    })?;
    if full.is_empty() {
        return Ok(());
    }
    write_dir(&full, c, dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use fsdp_alloc::Device;
    use fsdp_autograd::nn::Llama;
    use fsdp_autograd::{InitContext, Tensor};
    use fsdp_collectives::{ProcessGroup, ThreadGroup};
    use fsdp_core::{FsdpConfig, WrapPolicy};
    use safetensors::SafeTensors;

    use crate::hf::WEIGHTS;

    fn fixture(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name)
    }

    fn expected(name: &str) -> Value {
        let text = std::fs::read_to_string(fixture(name).join("expected.json")).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    /// Runs `f(device, fsdp)` on `world` thread ranks, each wrapping a fresh (seed 99)
    /// `nn::Llama` of `c` with one unit per decoder layer.
    fn on_ranks<T: Send + 'static>(
        world: usize,
        c: LlamaConfig,
        f: impl Fn(&Device, &Fsdp<Llama>) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let f = Arc::new(f);
        let hs: Vec<_> = ThreadGroup::new(world)
            .into_iter()
            .enumerate()
            .map(|(r, pg)| {
                let f = Arc::clone(&f);
                std::thread::spawn(move || {
                    let dev = Device::cpu(r);
                    let model = Llama::new(&InitContext::eager(&dev, 99), &c).unwrap();
                    let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
                    let cfg = FsdpConfig {
                        wrap_policy: WrapPolicy::ModuleTypes(vec!["LlamaDecoderLayer".into()]),
                        ..FsdpConfig::default()
                    };
                    let fsdp = Fsdp::wrap(model, &dev, pg, cfg).unwrap();
                    f(&dev, &fsdp)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    }

    fn logits(
        dev: &Device,
        forward: impl FnOnce(&Tensor) -> Result<Tensor, String>,
        tokens: &[i64],
    ) -> Vec<f32> {
        let ids = Tensor::from_vec(tokens.to_vec(), &[1, tokens.len()], dev).unwrap();
        fsdp_autograd::no_grad(|| forward(&ids))
            .unwrap()
            .to_vec::<f32>()
            .unwrap()
    }

    fn tokens_of(want: &Value) -> Vec<i64> {
        want["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_i64().unwrap())
            .collect()
    }

    /// Every position's logits of every `stride`-th id within 1e-5 of the position's largest
    /// |logit|, and the full-vocabulary log-sum-exp within 1e-5 relative.
    fn assert_close(what: &str, got: &[f32], vocab: usize, ids: &Value, want: &Value) {
        let ids: Vec<usize> = ids
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as usize)
            .collect();
        let rows = want["logits"].as_array().unwrap();
        assert_eq!(rows.len() * vocab, got.len(), "{what}: positions");
        crate::hf::assert_logits_close(what, got, vocab, &ids, want);
    }

    #[test]
    fn fixture_config_reads_rope_parameters_and_grouping() {
        let ck = LlamaCheckpoint::open(&fixture("llama-tiny")).unwrap();
        let c = ck.config.model;
        assert_eq!(
            (
                c.vocab,
                c.d_model,
                c.n_layers,
                c.n_heads,
                c.n_kv_heads,
                c.ffn_dim
            ),
            (384, 64, 2, 4, 2, 96)
        );
        assert_eq!(
            (c.seq_len, ck.config.max_positions, c.tied),
            (64, 64, false)
        );
        assert_eq!(c.rope_theta, 10_000.0);
        assert_eq!(
            c.rope_scaling,
            Some(Llama3Scaling {
                factor: 4.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 16
            })
        );
        // The transformers 4 spelling of the same configuration reads the same.
        let mut v: Value =
            serde_json::from_slice(&std::fs::read(fixture("llama-tiny").join(CONFIG)).unwrap())
                .unwrap();
        let o = v.as_object_mut().unwrap();
        let mut p = o.remove("rope_parameters").unwrap();
        o.insert("rope_theta".into(), p["rope_theta"].take());
        p.as_object_mut().unwrap().remove("rope_theta");
        o.insert("rope_scaling".into(), p);
        let old = LlamaHfConfig::from_json(Path::new("c.json"), &v).unwrap();
        assert_eq!(old, ck.config);
        // And the export's config.json reads back to the same model.
        let back =
            LlamaHfConfig::from_json(Path::new("c.json"), &LlamaHfConfig::to_json(&c)).unwrap();
        assert_eq!(back.model, c);
    }

    /// transformers' float32 logits of the fixture against ours, loaded through `--init-from`'s
    /// sharded path on 2 ranks.
    #[test]
    fn fixture_logits_match_transformers() {
        let want = expected("llama-tiny");
        let c = LlamaCheckpoint::open(&fixture("llama-tiny"))
            .unwrap()
            .config
            .model;
        let toks = tokens_of(&want);
        let got = on_ranks(2, c, move |dev, fsdp| {
            let ck = LlamaCheckpoint::open(&fixture("llama-tiny")).unwrap();
            load_into(fsdp, &ck, &c).unwrap();
            logits(dev, |x| fsdp.forward(x).map_err(|e| e.to_string()), &toks)
        });
        assert_eq!(got[0], got[1], "ranks agree");
        assert_close("llama-tiny", &got[0], c.vocab, &want["ids"], &want);
    }

    /// The same weights as a tied model (the head is the embedding; a plain model filled from
    /// the checkpoint's full state dict) match transformers' tied logits.
    #[test]
    fn tied_logits_match_transformers() {
        let want = expected("llama-tiny");
        let ck = LlamaCheckpoint::open(&fixture("llama-tiny")).unwrap();
        let c = ck.config.model.with_tied(true);
        let full = ck.full_state_dict(&c);
        assert!(full.get("lm_head.weight").is_none());
        let dev = Device::cpu(0);
        let m = Llama::new(&InitContext::eager(&dev, 0), &c).unwrap();
        full.load_into_module(&m).unwrap();
        let got = logits(
            &dev,
            |x| m.forward(x).map_err(|e| e.to_string()),
            &tokens_of(&want),
        );
        assert_close("tied", &got, c.vocab, &want["ids"], &want["tied_logits"]);
        // A tied model does not take the untied file through --init-from.
        assert!(matches!(check_model(&ck, &c), Err(HfError::Model { .. })));
    }

    /// A bfloat16 checkpoint in three shards (`model.safetensors.index.json`) loads, widened
    /// exactly: transformers' logits of the widened weights, on 3 ranks.
    #[test]
    fn bf16_sharded_checkpoint_matches_transformers() {
        let want = expected("llama-tiny-bf16-sharded");
        let ck = LlamaCheckpoint::open(&fixture("llama-tiny-bf16-sharded")).unwrap();
        assert!(
            ck.path().ends_with(crate::hf::INDEX),
            "{}",
            ck.path().display()
        );
        let shards: std::collections::BTreeSet<&Path> = ck
            .files
            .tensors
            .values()
            .map(|e| ck.files.file_of(e))
            .collect();
        assert_eq!(shards.len(), 3, "{shards:?}");
        let c = ck.config.model;
        let toks = tokens_of(&want);
        let got = on_ranks(3, c, move |dev, fsdp| {
            let ck = LlamaCheckpoint::open(&fixture("llama-tiny-bf16-sharded")).unwrap();
            load_into(fsdp, &ck, &c).unwrap();
            logits(dev, |x| fsdp.forward(x).map_err(|e| e.to_string()), &toks)
        });
        assert_eq!(got[0], got[2], "ranks agree");
        assert_close("bf16 sharded", &got[0], c.vocab, &want["ids"], &want);
    }

    /// Export → import is bit for bit: the export holds exactly the fixture's tensors, and a
    /// model loaded from it (on another world size) equals one loaded from the fixture.
    #[test]
    fn export_import_round_trip_is_bitwise() {
        let out = tempfile::tempdir().unwrap();
        let dir = out.path().join("hf");
        let c = LlamaCheckpoint::open(&fixture("llama-tiny"))
            .unwrap()
            .config
            .model;
        let d2 = dir.clone();
        let first = on_ranks(2, c, move |_, fsdp| {
            load_into(
                fsdp,
                &LlamaCheckpoint::open(&fixture("llama-tiny")).unwrap(),
                &c,
            )
            .unwrap();
            export(fsdp, &c, &d2).unwrap();
            state_dict::full_state_dict(fsdp, false).unwrap()
        });
        let orig = std::fs::read(fixture("llama-tiny").join(WEIGHTS)).unwrap();
        let orig = SafeTensors::deserialize(&orig).unwrap();
        let new = std::fs::read(dir.join(WEIGHTS)).unwrap();
        let new = SafeTensors::deserialize(&new).unwrap();
        let (mut a_names, mut b_names) = (orig.names(), new.names());
        a_names.sort();
        b_names.sort();
        assert_eq!(a_names, b_names);
        for n in a_names {
            let (a, b) = (orig.tensor(n).unwrap(), new.tensor(n).unwrap());
            assert_eq!((a.shape(), a.dtype()), (b.shape(), b.dtype()), "{n}");
            assert!(a.data() == b.data(), "{n} differs");
        }
        let back = LlamaCheckpoint::open(&dir).unwrap().config;
        assert_eq!(back.model, c);
        let d3 = dir.clone();
        let second = on_ranks(3, c, move |_, fsdp| {
            load_into(fsdp, &LlamaCheckpoint::open(&d3).unwrap(), &c).unwrap();
            state_dict::full_state_dict(fsdp, false).unwrap()
        });
        for (a, b) in first[0].entries.iter().zip(&second[0].entries) {
            assert_eq!(a.name, b.name);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a.values), bits(&b.values), "{}", a.name);
        }
    }

    /// Keys and values nn::Llama does not implement are refused, naming the key.
    #[test]
    fn unknown_or_unsupported_config_keys_are_refused_by_name() {
        let base: Value =
            serde_json::from_slice(&std::fs::read(fixture("llama-tiny").join(CONFIG)).unwrap())
                .unwrap();
        let with = |k: &str, x: Value| {
            let mut v = base.clone();
            v.as_object_mut().unwrap().insert(k.into(), x);
            LlamaHfConfig::from_json(Path::new("config.json"), &v)
                .unwrap_err()
                .to_string()
        };
        assert!(with("sliding_window", json!(4096)).contains("unknown key `sliding_window`"));
        assert!(with("attention_bias", json!(true)).contains("`attention_bias` is true"));
        assert!(with("mlp_bias", json!(true)).contains("`mlp_bias` is true"));
        assert!(with("hidden_act", json!("gelu")).contains("hidden_act `gelu`"));
        assert!(with("head_dim", json!(32)).contains("head_dim 32"));
        let e = with(
            "rope_parameters",
            json!({"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}),
        );
        assert!(e.contains("rope_type` is `yarn`"), "{e}");
        let e = with(
            "rope_parameters",
            json!({"rope_type": "llama3", "rope_theta": 1e4}),
        );
        assert!(e.contains("factor` is missing"), "{e}");
        let e = with("model_type", json!("mistral"));
        assert!(e.contains("model_type is `mistral`"), "{e}");
    }
}
