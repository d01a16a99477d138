//! Hugging Face models in and out: `--init-from PATH` and `--export-hf DIR`.
//!
//! A Hugging Face model directory as transformers' `save_pretrained` writes it: a
//! `model.safetensors` and a `config.json` side by side. This module holds what every
//! architecture shares (the error type, the file names, the directory writer); each architecture
//! is a file beside it with its configuration, its tensor-name map, loading and export:
//! `gpt2.rs` (`GPT2LMHeadModel`, `nn::Gpt`) with its `config.json` allow-list in
//! `gpt2_config.rs`, `llama.rs` (`LlamaForCausalLM`, `nn::Llama`); `tensors.rs` reads a
//! directory's tensors, one file or the shards of an index. [`detect`] says which architecture
//! a directory holds.

mod gpt2;
mod gpt2_config;
pub mod llama;
mod tensors;

pub use gpt2::{check_model, export, load_into, HfCheckpoint};
pub use gpt2_config::HfConfig;
pub use llama::LlamaCheckpoint;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorInfo, TensorView};
use serde_json::Value;

use crate::cleanup::TempFile;

/// The tensors file inside a Hugging Face model directory.
pub const WEIGHTS: &str = "model.safetensors";
/// The configuration file inside a Hugging Face model directory.
pub const CONFIG: &str = "config.json";
/// The index of a sharded checkpoint (tensor name → shard file).
pub const INDEX: &str = "model.safetensors.index.json";

/// The Hugging Face architectures `--init-from` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// `GPT2LMHeadModel` (`gpt2.rs`).
    Gpt2,
    /// `LlamaForCausalLM` (`llama.rs`).
    Llama,
}

/// The architecture of the checkpoint at `path` (a directory, or a file in it): Llama when its
/// `config.json` says `model_type` `llama` or names `LlamaForCausalLM`, or when the weights are
/// sharded (`model.safetensors.index.json`, which only the Llama loader reads); GPT-2
/// otherwise (whose loader then says what is missing).
pub fn detect(path: &Path) -> Arch {
    let dir = if path.is_dir() {
        path.to_path_buf()
    } else {
        path.parent()
            .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
    };
    let sharded = path.to_string_lossy().ends_with(".index.json")
        || (path.is_dir() && !dir.join(WEIGHTS).exists() && dir.join(INDEX).exists());
    let cfg = std::fs::read(dir.join(CONFIG))
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok());
    let llama = cfg.is_some_and(|v| {
        v.get("model_type").and_then(Value::as_str) == Some("llama")
            || v.get("architectures")
                .and_then(Value::as_array)
                .is_some_and(|a| a.iter().any(|x| x.as_str() == Some("LlamaForCausalLM")))
    });
    if llama || sharded {
        Arch::Llama
    } else {
        Arch::Gpt2
    }
}

/// A problem with a Hugging Face model file, with what was expected.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Not a safetensors file, or a malformed one.
    #[error("{path}: not a readable safetensors file ({detail})")]
    Format {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        detail: String,
    },
    /// `config.json` is missing a field, has a wrong one, or names another architecture.
    #[error("{path}: {detail}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong and what was expected.
        detail: String,
    },
    /// An expected tensor is not in the file.
    #[error("{path}: no tensor `{name}`; expected {expected}{found}")]
    Missing {
        /// The file.
        path: PathBuf,
        /// The first missing tensor.
        name: String,
        /// The layout expected, e.g. `a Hugging Face GPT2LMHeadModel file (transformer.wte, …)`.
        expected: &'static str,
        /// `; it holds e.g. …` (a few of the file's names), or empty.
        found: String,
    },
    /// A tensor has the wrong shape.
    #[error(
        "{path}: tensor `{name}` has shape {got:?}, expected {want:?} for the configured model"
    )]
    Shape {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// Its shape.
        got: Vec<usize>,
        /// The shape expected.
        want: Vec<usize>,
    },
    /// A tensor of a dtype that is not F32, F16 or BF16.
    #[error("{path}: tensor `{name}` is {dtype}, expected F32, F16 or BF16")]
    Dtype {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// Its dtype.
        dtype: String,
    },
    /// A tensor this layout does not have.
    #[error("{path}: unexpected tensor `{name}` (not part of {arch}'s layout)")]
    Unexpected {
        /// The file.
        path: PathBuf,
        /// The architecture whose layout was expected (`GPT2LMHeadModel`, `LlamaForCausalLM`).
        arch: &'static str,
        /// The tensor.
        name: String,
    },
    /// The model to load into does not fit the file.
    #[error("--init-from {path}: {detail}")]
    Model {
        /// The file.
        path: PathBuf,
        /// What differs.
        detail: String,
    },
    /// A state-dict operation failed.
    #[error("{context}: {source}")]
    StateDict {
        /// What was being done.
        context: String,
        /// The cause.
        source: Box<fsdp_core::StateDictError>,
    },
}

/// [`HfError::Missing`] for `name`, listing a few of the file's names.
pub(crate) fn missing(
    path: &Path,
    tensors: &HashMap<String, TensorInfo>,
    name: &str,
    expected: &'static str,
) -> HfError {
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let found = if names.is_empty() {
        "; the file holds no tensors".to_string()
    } else {
        let few: Vec<&str> = names.iter().take(3).map(|s| s.as_str()).collect();
        format!("; it holds e.g. {}", few.join(", "))
    };
    HfError::Missing {
        path: path.to_path_buf(),
        name: name.to_string(),
        expected,
        found,
    }
}

/// A tensor in Hugging Face's naming: name, shape, row-major f32 values.
pub(crate) type HfTensor = (String, Vec<usize>, Vec<f32>);

/// Writes a Hugging Face model directory `dir`: `model.safetensors` (the `tensors`, F32, metadata
/// `format = pt`, as transformers expects) and `config.json` (`config`), each written to a
/// temporary name, fsynced and renamed, both with the mode the umask gives new files. Whether
/// `dir` may be written at all (not the `--init-from` model, no earlier export without
/// `--overwrite`) is decided before training (`paths::check`, `paths::check_existing`).
///
/// # Errors
/// [`HfError::Io`], [`HfError::Format`].
pub(crate) fn write_model_dir(
    dir: &Path,
    tensors: Vec<HfTensor>,
    config: &Value,
) -> Result<(), HfError> {
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |source| HfError::Io { path: p, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, s, v)| (n, s, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views: Vec<(String, TensorView<'_>)> = bytes
        .iter()
        .map(|(n, s, b)| {
            TensorView::new(Dtype::F32, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| HfError::Format {
                    path: dir.join(WEIGHTS),
                    detail: e.to_string(),
                })
        })
        .collect::<Result<_, _>>()?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    // The temporary files are removed on every error path and on a fatal signal.
    let cfg = dir.join(CONFIG);
    let cfg_tmp = TempFile::new(dir.join(format!(".{CONFIG}.tmp{}", std::process::id())));
    let text = serde_json::to_string_pretty(config).expect("JSON of plain values");
    // Created by std, so with 0666 less the umask: the weights get the same mode below.
    std::fs::write(cfg_tmp.path(), text + "\n").map_err(io(cfg_tmp.path()))?;
    let mode = std::fs::metadata(cfg_tmp.path())
        .map_err(io(cfg_tmp.path()))?
        .permissions();
    let weights = dir.join(WEIGHTS);
    let tmp = TempFile::new(dir.join(format!(".{WEIGHTS}.tmp{}", std::process::id())));
    safetensors::serialize_to_file(views, Some(meta), tmp.path()).map_err(|e| HfError::Format {
        path: tmp.path().to_path_buf(),
        detail: e.to_string(),
    })?;
    // The safetensors crate writes through a private (0600) temporary file: give the weights
    // the mode every other file of the export has (issue #37, 2), and make them durable.
    std::fs::set_permissions(tmp.path(), mode).map_err(io(tmp.path()))?;
    for t in [&tmp, &cfg_tmp] {
        std::fs::File::open(t.path())
            .and_then(|f| f.sync_all())
            .map_err(io(t.path()))?;
    }
    std::fs::rename(tmp.path(), &weights).map_err(io(&weights))?;
    tmp.keep();
    std::fs::rename(cfg_tmp.path(), &cfg).map_err(io(&cfg))?;
    cfg_tmp.keep();
    Ok(())
}

/// Test helper for the fixtures made with transformers: every position's logits `got`
/// (`positions × vocab`, row-major) at the ids `ids` are within 1e-5 of `want["logits"]` relative
/// to the position's largest |logit|, and the full-vocabulary log-sum-exp within 1e-5 relative of
/// `want["logsumexp"]`; `what` names the case in a failure.
#[cfg(test)]
pub(crate) fn assert_logits_close(
    what: &str,
    got: &[f32],
    vocab: usize,
    ids: &[usize],
    want: &Value,
) {
    let rows = want["logits"].as_array().unwrap();
    for (t, row) in rows.iter().enumerate() {
        let row: Vec<f64> = row
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        let scale = row.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        let mine = &got[t * vocab..(t + 1) * vocab];
        for (k, &id) in ids.iter().enumerate() {
            let err = (mine[id] as f64 - row[k]).abs() / scale;
            assert!(
                err <= 1e-5,
                "{what}: position {t} id {id}: {} vs {} (rel {err:e})",
                mine[id],
                row[k]
            );
        }
        let m = mine.iter().fold(f64::MIN, |m, &x| m.max(x as f64));
        let lse = m + mine.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
        let want_lse = want["logsumexp"][t].as_f64().unwrap();
        assert!(
            ((lse - want_lse) / want_lse).abs() <= 1e-5,
            "{what}: position {t}: logsumexp {lse} vs {want_lse}"
        );
    }
}
