//! GPT-2's `config.json` (transformers' `GPT2Config`, checked against transformers 5.24) read
//! through an **allow-list**, and written back.
//!
//! Every key is in exactly one of three groups, and a key in none of them is refused, naming
//! it — so a key a future transformers version adds (which might change the model) stops the
//! load instead of being ignored:
//! - **computation** ([`COMPUTE`]): read into [`HfConfig`] and implemented as transformers'
//!   `GPT2LMHeadModel` computes them: the sizes (`vocab_size`, `n_positions`, `n_embd`,
//!   `n_layer`, `n_head`, `n_inner`), `activation_function` (the GELUs of [`ACTIVATIONS`]; any
//!   other activation is refused naming the value), `layer_norm_epsilon`,
//!   `tie_word_embeddings`, `scale_attn_weights`, `scale_attn_by_inverse_layer_idx`,
//!   `reorder_and_upcast_attn` (with f32 weights the scores and softmax are computed in f32
//!   either way; ours always are), the three dropout probabilities (training only, in `[0, 1)`);
//!   a missing key takes `GPT2Config`'s default;
//! - **fixed** ([`FIXED`]): accepted only at the value that leaves the language model unchanged
//!   (`add_cross_attention: false`, `pruned_heads: {}`), refused otherwise;
//! - **carried** ([`CARRIED`]): keys that do not change the forward (ids, `architectures`,
//!   `task_specific_params`, `use_cache`, `dtype`/`torch_dtype`, `transformers_version`, the
//!   sequence-summary head's `summary_*`, generation defaults of older files, …): kept as they
//!   are and written back by the export.
//!
//! [`HfConfig::to_json`] writes what a model was trained with: its sizes (the whole position
//! table), activation, epsilon, tying, attention scaling and dropouts, plus the source's carried
//! keys.

use std::path::Path;

use fsdp_autograd::nn::{AttnScaling, Gelu, GptConfig, GptDropout};
use serde_json::{json, Map, Value};

use super::HfError;

/// The keys that set the computation (read into [`HfConfig`]).
pub const COMPUTE: &[&str] = &[
    "model_type",
    "vocab_size",
    "n_positions",
    "n_embd",
    "n_layer",
    "n_head",
    "n_inner",
    "activation_function",
    "layer_norm_epsilon",
    "tie_word_embeddings",
    "scale_attn_weights",
    "scale_attn_by_inverse_layer_idx",
    "reorder_and_upcast_attn",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
];

/// Keys accepted only at the value (as JSON text) that leaves the language model unchanged,
/// with what the other values would do.
pub const FIXED: &[(&str, &str, &str)] = &[
    (
        "add_cross_attention",
        "false",
        "cross-attention layers (an encoder-decoder GPT-2) are not supported",
    ),
    (
        "pruned_heads",
        "{}",
        "pruned attention heads are not supported",
    ),
];

/// Keys that do not change the forward: carried into the export unchanged.
pub const CARRIED: &[&str] = &[
    // Identity and provenance.
    "architectures",
    "transformers_version",
    "_name_or_path",
    "_commit_hash",
    "_attn_implementation_autoset",
    "dtype",
    "torch_dtype",
    "use_bfloat16",
    "initializer_range",
    // Token ids and labels.
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "id2label",
    "label2id",
    "num_labels",
    "problem_type",
    "finetuning_task",
    "tokenizer_class",
    "prefix",
    "task_specific_params",
    // Outputs and caching.
    "use_cache",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "torchscript",
    "tf_legacy_loss",
    "output_past",
    "gradient_checkpointing",
    "n_ctx",
    // Encoder-decoder plumbing GPT2LMHeadModel does not use without cross-attention.
    "is_decoder",
    "is_encoder_decoder",
    "tie_encoder_decoder",
    "cross_attention_hidden_size",
    "chunk_size_feed_forward",
    // The sequence-summary head of GPT2DoubleHeadsModel.
    "summary_type",
    "summary_use_proj",
    "summary_activation",
    "summary_proj_to_labels",
    "summary_first_dropout",
    "summary_last_dropout",
    // Generation defaults (older files keep them in config.json).
    "max_length",
    "min_length",
    "do_sample",
    "early_stopping",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "num_return_sequences",
    "output_scores",
    "return_dict_in_generate",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
];

/// The `activation_function` values computed exactly, and the GELU each is: transformers'
/// `gelu_new`, `gelu_pytorch_tanh`, `gelu_python_tanh`, `gelu_fast` and `gelu_accurate` are all
/// the tanh approximation `½x(1 + tanh(√(2/π)(x + 0.044715x³)))` (differing only in how the
/// constant and the polynomial are rounded), `gelu` and `gelu_python` the exact `x·Φ(x)`.
pub const ACTIVATIONS: &[(&str, Gelu)] = &[
    ("gelu_new", Gelu::Tanh),
    ("gelu_pytorch_tanh", Gelu::Tanh),
    ("gelu_python_tanh", Gelu::Tanh),
    ("gelu_fast", Gelu::Tanh),
    ("gelu_accurate", Gelu::Tanh),
    ("gelu", Gelu::Exact),
    ("gelu_python", Gelu::Exact),
];

/// A Hugging Face GPT-2 `config.json`: what changes the computation, and the keys carried.
#[derive(Debug, Clone, PartialEq)]
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
    /// `n_inner` (`None`: `4·n_embd`).
    pub n_inner: Option<usize>,
    /// `activation_function` as spelled (one of [`ACTIVATIONS`]).
    pub activation: String,
    /// The GELU it is.
    pub gelu: Gelu,
    /// `layer_norm_epsilon`.
    pub ln_eps: f64,
    /// `tie_word_embeddings` (true when absent, as in transformers). Cleared when the file
    /// carries a distinct `lm_head.weight` (see `HfCheckpoint::open`).
    pub tied: bool,
    /// `scale_attn_weights`, `scale_attn_by_inverse_layer_idx`.
    pub scaling: AttnScaling,
    /// `reorder_and_upcast_attn` (no effect on f32 computation; written back).
    pub reorder_and_upcast_attn: bool,
    /// `embd_pdrop`, `attn_pdrop`, `resid_pdrop`.
    pub dropout: GptDropout,
    /// The [`CARRIED`] keys present (and the [`FIXED`] ones, at their neutral values), with
    /// their values.
    pub carried: Map<String, Value>,
}

impl HfConfig {
    /// The model config: these sizes, options and dropouts, sequence length `n_positions`
    /// (the whole position table).
    pub fn gpt(&self) -> GptConfig {
        let mut g = GptConfig::new(
            self.vocab,
            self.d_model,
            self.n_layers,
            self.n_heads,
            self.n_positions,
        )
        .with_positions(self.n_positions)
        .with_tied(self.tied)
        .with_gelu(self.gelu)
        .with_ln_eps(self.ln_eps as f32)
        .with_attn_scaling(self.scaling)
        .with_dropout(self.dropout);
        if let Some(n) = self.n_inner {
            g = g.with_inner(n);
        }
        g
    }

    /// Reads and parses the `config.json` of a model directory `path`, or the one beside the
    /// weights file `path`.
    ///
    /// # Errors
    /// [`HfError::Io`] and [`HfError::Config`] (as [`HfConfig::from_json`]).
    pub fn read_beside(path: &Path) -> Result<HfConfig, HfError> {
        let dir = if path.is_dir() {
            path
        } else {
            path.parent().unwrap_or(Path::new("."))
        };
        let file = dir.join(super::CONFIG);
        let text = std::fs::read(&file).map_err(|source| HfError::Io {
            path: file.clone(),
            source,
        })?;
        let v: Value = serde_json::from_slice(&text).map_err(|e| HfError::Config {
            path: file.clone(),
            detail: format!("not JSON: {e}"),
        })?;
        HfConfig::from_json(&file, &v)
    }

    /// Parses a `config.json` value (`path` names it in errors) through the allow-list.
    ///
    /// # Errors
    /// [`HfError::Config`] naming the first key that is unknown, of the wrong type, out of
    /// range, or at a value train_gpt does not compute.
    pub fn from_json(path: &Path, v: &Value) -> Result<HfConfig, HfError> {
        let bad = |detail: String| HfError::Config {
            path: path.to_path_buf(),
            detail,
        };
        let obj = v
            .as_object()
            .ok_or_else(|| bad("not a JSON object".into()))?;
        let mut carried = Map::new();
        for (k, val) in obj {
            if COMPUTE.contains(&k.as_str()) {
                continue;
            }
            if let Some((_, want, why)) = FIXED.iter().find(|(n, ..)| n == k) {
                if serde_json::from_str::<Value>(want).ok().as_ref() != Some(val) {
                    return Err(bad(format!("`{k}` is {val}: {why} (only {want})")));
                }
                // At its neutral value it is carried like the keys without effect.
                carried.insert(k.clone(), val.clone());
                continue;
            }
            if CARRIED.contains(&k.as_str()) {
                carried.insert(k.clone(), val.clone());
                continue;
            }
            return Err(bad(format!(
                "unknown key `{k}` (value {}): not a GPT2Config setting train_gpt knows \
                 (transformers 5.24); it may change the model, so the file is refused — remove \
                 the key if it does not",
                short(val)
            )));
        }
        if let Some(t) = obj.get("model_type") {
            if t.as_str() != Some("gpt2") {
                return Err(bad(format!(
                    "model_type is {t}, expected \"gpt2\" (a GPT2LMHeadModel config)"
                )));
            }
        }
        let size = |key: &str, default: usize| -> Result<usize, HfError> {
            match obj.get(key) {
                None => Ok(default),
                Some(x) => x
                    .as_u64()
                    .filter(|&n| n > 0 && n <= 1 << 24)
                    .map(|n| n as usize)
                    .ok_or_else(|| bad(format!("`{key}` is {x}, not a positive integer"))),
            }
        };
        let flag = |key: &str, default: bool| -> Result<bool, HfError> {
            match obj.get(key) {
                None => Ok(default),
                Some(x) => x
                    .as_bool()
                    .ok_or_else(|| bad(format!("`{key}` is {x}, not true or false"))),
            }
        };
        let prob = |key: &str| -> Result<f32, HfError> {
            match obj.get(key) {
                None => Ok(0.1),
                Some(x) => x
                    .as_f64()
                    .filter(|p| (0.0..1.0).contains(p))
                    .map(|p| p as f32)
                    .ok_or_else(|| {
                        bad(format!(
                            "`{key}` is {x}: a dropout probability must be a number in [0, 1)"
                        ))
                    }),
            }
        };
        let d_model = size("n_embd", 768)?;
        let n_heads = size("n_head", 12)?;
        let n_inner = match obj.get("n_inner") {
            None | Some(Value::Null) => None,
            Some(_) => Some(size("n_inner", 0)?),
        };
        let activation = match obj.get("activation_function") {
            None => "gelu_new".to_string(),
            Some(x) => x
                .as_str()
                .ok_or_else(|| bad(format!("`activation_function` is {x}, not a name")))?
                .to_string(),
        };
        let gelu = ACTIVATIONS
            .iter()
            .find(|(n, _)| *n == activation)
            .map(|(_, g)| *g)
            .ok_or_else(|| {
                let names: Vec<&str> = ACTIVATIONS.iter().map(|(n, _)| *n).collect();
                bad(format!(
                    "`activation_function` is \"{activation}\", which train_gpt's kernels do not \
                     compute (supported: {})",
                    names.join(", ")
                ))
            })?;
        let ln_eps = match obj.get("layer_norm_epsilon") {
            None => 1e-5,
            Some(x) => x
                .as_f64()
                .filter(|e| e.is_finite() && *e >= 0.0 && (*e as f32).is_finite())
                .ok_or_else(|| {
                    bad(format!(
                        "`layer_norm_epsilon` is {x}, not a finite number ≥ 0"
                    ))
                })?,
        };
        let c = HfConfig {
            vocab: size("vocab_size", 50257)?,
            n_positions: size("n_positions", 1024)?,
            d_model,
            n_layers: size("n_layer", 12)?,
            n_heads,
            n_inner,
            activation,
            gelu,
            ln_eps,
            tied: flag("tie_word_embeddings", true)?,
            scaling: AttnScaling {
                by_head_dim: flag("scale_attn_weights", true)?,
                by_inverse_layer: flag("scale_attn_by_inverse_layer_idx", false)?,
            },
            reorder_and_upcast_attn: flag("reorder_and_upcast_attn", false)?,
            dropout: GptDropout {
                embd: prob("embd_pdrop")?,
                attn: prob("attn_pdrop")?,
                resid: prob("resid_pdrop")?,
            },
            carried,
        };
        if c.d_model % c.n_heads != 0 {
            return Err(bad(format!(
                "n_embd {} is not divisible by n_head {}",
                c.d_model, c.n_heads
            )));
        }
        Ok(c)
    }

    /// The `config.json` of a model of config `g` as transformers'
    /// `GPT2LMHeadModel.from_pretrained` reads it: what `g` computes (sizes with the whole
    /// position table, activation, epsilon, tying, attention scaling, dropouts; the F32 dtype of
    /// the export's tensors) over `source`'s carried keys (the `--init-from` config, if any),
    /// its spelling of the activation when it is the same GELU, and its
    /// `reorder_and_upcast_attn`.
    pub fn to_json(g: &GptConfig, source: Option<&HfConfig>) -> Value {
        let mut o = Map::new();
        if let Some(s) = source {
            o.extend(s.carried.clone());
        }
        let activation = match source {
            Some(s) if s.gelu == g.gelu => s.activation.clone(),
            _ => match g.gelu {
                Gelu::Tanh => "gelu_new".to_string(),
                Gelu::Exact => "gelu".to_string(),
            },
        };
        let reorder = source.is_some_and(|s| s.reorder_and_upcast_attn);
        let n_inner = match g.n_inner {
            Some(n) => json!(n),
            None => Value::Null,
        };
        let d = g.dropout;
        let set = [
            ("architectures", json!(["GPT2LMHeadModel"])),
            ("model_type", json!("gpt2")),
            ("vocab_size", json!(g.vocab)),
            ("n_positions", json!(g.positions())),
            ("n_embd", json!(g.d_model)),
            ("n_layer", json!(g.n_layers)),
            ("n_head", json!(g.n_heads)),
            ("n_inner", n_inner),
            ("activation_function", json!(activation)),
            ("layer_norm_epsilon", decimal(g.ln_eps)),
            ("tie_word_embeddings", json!(g.tied)),
            ("scale_attn_weights", json!(g.attn_scaling.by_head_dim)),
            (
                "scale_attn_by_inverse_layer_idx",
                json!(g.attn_scaling.by_inverse_layer),
            ),
            ("reorder_and_upcast_attn", json!(reorder)),
            ("resid_pdrop", decimal(d.resid)),
            ("embd_pdrop", decimal(d.embd)),
            ("attn_pdrop", decimal(d.attn)),
            ("dtype", json!("float32")),
        ];
        for (k, v) in set {
            o.insert(k.to_string(), v);
        }
        if o.contains_key("torch_dtype") {
            o.insert("torch_dtype".into(), json!("float32"));
        }
        for (k, v) in [
            ("bos_token_id", json!(50256)),
            ("eos_token_id", json!(50256)),
            ("initializer_range", json!(0.02)),
        ] {
            o.entry(k).or_insert(v);
        }
        Value::Object(o)
    }
}

/// An f32 as the shortest decimal that reads back as it (`1e-5`, not `9.999999747378752e-6`).
fn decimal(x: f32) -> Value {
    json!(x.to_string().parse::<f64>().unwrap_or(f64::from(x)))
}

/// A value for an error line: at most 60 characters of its JSON.
fn short(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(60) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<HfConfig, String> {
        HfConfig::from_json(Path::new("config.json"), &v).map_err(|e| e.to_string())
    }

    fn base() -> Value {
        json!({
            "model_type": "gpt2", "vocab_size": 100, "n_positions": 32, "n_embd": 16,
            "n_layer": 2, "n_head": 4
        })
    }

    fn with(k: &str, v: Value) -> Value {
        let mut b = base();
        b[k] = v;
        b
    }

    #[test]
    fn defaults_are_gpt2_configs() {
        let c = parse(json!({})).unwrap();
        assert_eq!(
            (c.vocab, c.n_positions, c.d_model, c.n_layers, c.n_heads),
            (50257, 1024, 768, 12, 12)
        );
        assert_eq!((c.gelu, c.activation.as_str()), (Gelu::Tanh, "gelu_new"));
        assert_eq!(c.ln_eps, 1e-5);
        assert!(c.tied && c.scaling == AttnScaling::default() && !c.reorder_and_upcast_attn);
        assert_eq!(c.dropout, GptDropout::all(0.1));
        assert!(c.carried.is_empty());
    }

    #[test]
    fn every_key_group_is_distinct() {
        for k in COMPUTE {
            assert!(
                !CARRIED.contains(k) && !FIXED.iter().any(|f| f.0 == *k),
                "{k}"
            );
        }
        for k in CARRIED {
            assert!(!FIXED.iter().any(|f| f.0 == *k), "{k}");
        }
    }

    #[test]
    fn computation_keys_are_read() {
        let c = parse(json!({
            "n_embd": 16, "n_head": 4, "n_inner": 40, "activation_function": "gelu_fast",
            "layer_norm_epsilon": 0.001, "tie_word_embeddings": false,
            "scale_attn_weights": false, "scale_attn_by_inverse_layer_idx": true,
            "reorder_and_upcast_attn": true, "resid_pdrop": 0.0, "embd_pdrop": 0.2,
            "attn_pdrop": 0.3
        }))
        .unwrap();
        let g = c.gpt();
        assert_eq!(
            (g.inner(), g.gelu, g.ln_eps, g.tied),
            (40, Gelu::Tanh, 0.001, false)
        );
        assert_eq!(g.attn_scale(1), 0.5);
        assert_eq!(
            g.dropout,
            GptDropout {
                embd: 0.2,
                attn: 0.3,
                resid: 0.0
            }
        );
        assert!(c.reorder_and_upcast_attn);
    }

    /// Unknown keys, fixed keys at another value, unsupported activations, bad types and
    /// ranges are refused with one line naming the key (and the value).
    #[test]
    fn the_allow_list_refuses_naming_the_key() {
        for (v, want) in [
            (
                with("rotary_dim", json!(16)),
                "unknown key `rotary_dim` (value 16)",
            ),
            (
                with("quantization_config", json!({"bits": 4})),
                "unknown key `quantization_config`",
            ),
            (
                with("add_cross_attention", json!(true)),
                "`add_cross_attention` is true",
            ),
            (
                with("pruned_heads", json!({"0": [1]})),
                "`pruned_heads` is {\"0\":[1]}",
            ),
            (
                with("activation_function", json!("relu")),
                "`activation_function` is \"relu\"",
            ),
            (
                with("activation_function", json!("silu")),
                "`activation_function` is \"silu\"",
            ),
            (
                with("activation_function", json!("quick_gelu")),
                "`activation_function` is \"quick_gelu\"",
            ),
            (with("resid_pdrop", json!(1.0)), "`resid_pdrop` is 1.0"),
            (with("attn_pdrop", json!("x")), "`attn_pdrop` is \"x\""),
            (with("n_inner", json!(0)), "`n_inner` is 0"),
            (
                with("scale_attn_weights", json!(1)),
                "`scale_attn_weights` is 1",
            ),
            (
                with("layer_norm_epsilon", json!(-1.0)),
                "`layer_norm_epsilon` is -1.0",
            ),
            (
                with("model_type", json!("llama")),
                "model_type is \"llama\"",
            ),
            (
                with("n_head", json!(3)),
                "n_embd 16 is not divisible by n_head 3",
            ),
        ] {
            let e = parse(v).unwrap_err();
            assert!(e.contains(want), "{e}\n  wanted: {want}");
            assert!(!e.contains('\n'), "{e}");
        }
        // The fixed keys at their neutral values, and every carried key, are accepted.
        let mut ok = with("add_cross_attention", json!(false));
        ok["pruned_heads"] = json!({});
        for k in CARRIED {
            ok[*k] = json!(null);
        }
        assert_eq!(
            parse(ok).unwrap().carried.len(),
            CARRIED.len() + FIXED.len()
        );
    }

    /// The export writes what the model computes over the source's carried keys; read back, it
    /// is the same configuration.
    #[test]
    fn to_json_writes_back_what_was_used() {
        let mut v = with(
            "task_specific_params",
            json!({"text-generation": {"max_length": 50}}),
        );
        v["activation_function"] = json!("gelu_pytorch_tanh");
        v["n_ctx"] = json!(1024);
        v["torch_dtype"] = json!("bfloat16");
        v["layer_norm_epsilon"] = json!(1e-5);
        let src = parse(v).unwrap();
        let g = src.gpt();
        let out = HfConfig::to_json(&g, Some(&src));
        assert_eq!(
            out["task_specific_params"]["text-generation"]["max_length"],
            50
        );
        assert_eq!(out["n_ctx"], 1024);
        assert_eq!(out["activation_function"], "gelu_pytorch_tanh");
        assert_eq!(out["torch_dtype"], "float32");
        assert_eq!(out["layer_norm_epsilon"], json!(1e-5));
        assert_eq!(out["n_positions"], 32);
        assert_eq!(out["resid_pdrop"], json!(0.1));
        let mut back = parse(out).unwrap();
        back.carried.insert("torch_dtype".into(), json!("bfloat16"));
        back.carried.remove("dtype");
        back.carried.remove("architectures");
        back.carried.remove("bos_token_id");
        back.carried.remove("eos_token_id");
        back.carried.remove("initializer_range");
        assert_eq!(back, src);
        // A model trained with other settings writes those.
        let g2 = g
            .with_gelu(Gelu::Exact)
            .with_dropout(GptDropout::default())
            .with_positions(64);
        let out = HfConfig::to_json(&g2, Some(&src));
        assert_eq!(out["activation_function"], "gelu");
        assert_eq!(out["attn_pdrop"], json!(0.0));
        assert_eq!(out["n_positions"], 64);
    }
}
