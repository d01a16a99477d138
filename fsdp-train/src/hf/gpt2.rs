//! Hugging Face GPT-2 (`GPT2LMHeadModel`) in and out: `--init-from PATH` and `--export-hf DIR`.
//!
//! The layout is transformers' `GPT2LMHeadModel` as `save_pretrained` writes it: a
//! `model.safetensors` and a `config.json` side by side. Tensor names (the `transformer.` prefix
//! is optional on reading: the original GPT-2 upload has none):
//!
//! | ours (`nn::Gpt`) | Hugging Face | note |
//! |---|---|---|
//! | `tok_emb.weight` `[V, d]` | `transformer.wte.weight` `[V, d]` | |
//! | `pos_emb.weight` `[n_positions, d]` | `transformer.wpe.weight` `[n_positions, d]` | the whole table (training at a shorter `--seq-len` uses its first rows) |
//! | `blocks.N.ln1.{weight,bias}` | `transformer.h.N.ln_1.{weight,bias}` | |
//! | `blocks.N.attn.qkv.weight` `[3d, d]` | `transformer.h.N.attn.c_attn.weight` `[d, 3d]` | Conv1D: transposed |
//! | `blocks.N.attn.proj.weight` `[d, d]` | `transformer.h.N.attn.c_proj.weight` `[d, d]` | transposed |
//! | `blocks.N.ln2.{weight,bias}` | `transformer.h.N.ln_2.{weight,bias}` | |
//! | `blocks.N.mlp.fc.weight` `[inner, d]` | `transformer.h.N.mlp.c_fc.weight` `[d, inner]` | transposed; `inner` = `n_inner` or `4d` |
//! | `blocks.N.mlp.proj.weight` `[d, inner]` | `transformer.h.N.mlp.c_proj.weight` `[inner, d]` | transposed |
//! | `ln_f.{weight,bias}` | `transformer.ln_f.{weight,bias}` | |
//! | `head.weight` (untied only) | `lm_head.weight` | tied (GPT-2): not stored |
//!
//! Biases follow their weights untransposed. The attention's causal-mask buffers some files
//! carry (`attn.bias`, `attn.masked_bias`) are skipped; any other unknown tensor is refused.
//! A tied config (`tie_word_embeddings` true or absent) whose file carries an `lm_head.weight`
//! equal to `wte` loads tied; one whose `lm_head.weight` differs loads **untied** with the
//! file's head, as transformers does (it warns and does not tie them), and [`HfCheckpoint::note`]
//! says so. `config.json` is read through the allow-list of [`super::gpt2_config`].
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
//! expects; the whole position table) and `config.json` ([`HfConfig::to_json`]: what the model
//! computes — sizes, activation, epsilon, tying, attention scaling, dropouts — over the
//! `--init-from` config's carried keys).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::gpt2_config::HfConfig;
use super::{missing, write_model_dir, HfError, HfTensor, CONFIG, WEIGHTS};

use fsdp_autograd::nn::{GptConfig, Module};
use fsdp_core::state_dict::{self, FullStateDict, ShardedStateDict};
use fsdp_core::Fsdp;
use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, TensorInfo};
use safetensors::SafeTensors;
use serde_json::Value;

/// What a GPT-2 file must hold, as [`HfError::Missing`] says it.
const EXPECTED: &str = "a Hugging Face GPT2LMHeadModel file (transformer.wte, wpe, h.N.ln_1, \
                        attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj, ln_f)";

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
        ("pos_emb.weight".to_string(), vec![g.positions(), d]),
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
        v.push((format!("{b}.mlp.fc.weight"), vec![g.inner(), d]));
        v.push((format!("{b}.mlp.fc.bias"), vec![g.inner()]));
        v.push((format!("{b}.mlp.proj.weight"), vec![d, g.inner()]));
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
    /// The configuration (`config.json` beside the weights; `tied` cleared when the file's
    /// head differs from its embedding).
    pub config: HfConfig,
    /// Set when a tied config's file carried a distinct `lm_head.weight` (untied, as
    /// transformers does): the line to print.
    note: Option<String>,
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
        // A regular file, checked on the opened file: a FIFO would block the open forever.
        let f = crate::input::open_regular(&file).map_err(io(&file))?;
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
        let text = crate::input::read_regular(&cfg_path).map_err(io(&cfg_path))?;
        let v: Value = serde_json::from_slice(&text).map_err(|e| HfError::Config {
            path: cfg_path.clone(),
            detail: format!("not JSON: {e}"),
        })?;
        let config = HfConfig::from_json(&cfg_path, &v)?;
        let mut ck = HfCheckpoint {
            path: file,
            map,
            data_start: 8 + n,
            tensors,
            prefix: prefix.to_string(),
            config,
            note: None,
        };
        ck.untie_a_distinct_head()?;
        ck.validate()?;
        Ok(ck)
    }

    /// The weights file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// What loading changed against `config.json`, to print (a distinct `lm_head.weight` under a
    /// tied config: untied).
    pub fn note(&self) -> Option<&str> {
        self.note.as_deref()
    }

    /// Under a tied config, a file whose `lm_head.weight` has `wte`'s shape and dtype but other
    /// values is loaded untied with that head (transformers: "both are present in the
    /// checkpoints with different values, so we will NOT tie them").
    fn untie_a_distinct_head(&mut self) -> Result<(), HfError> {
        let wte = full_name(&self.prefix, "wte.weight");
        let (Some(head), Some(emb)) = (self.tensors.get("lm_head.weight"), self.tensors.get(&wte))
        else {
            return Ok(());
        };
        if !self.config.tied || head.shape != emb.shape {
            return Ok(());
        }
        let n: usize = head.shape.iter().product();
        let ok = |i: &TensorInfo| matches!(i.dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16);
        if !ok(head) || !ok(emb) {
            return Ok(()); // validate() names the dtype
        }
        let differs =
            (0..n).any(|i| self.element(head, i).to_bits() != self.element(emb, i).to_bits());
        if differs {
            self.config.tied = false;
            self.note = Some(format!(
                "{}: lm_head.weight differs from {wte} although config.json ties them \
                 (tie_word_embeddings); loaded untied with the file's head, as transformers does",
                self.path.display()
            ));
        }
        Ok(())
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
                // A tied model's file may still carry the head (equal to wte: a distinct one
                // has untied the model).
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
    /// `--vocab`) are zero.
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

/// Checks that a model of config `g` can take `ck`'s weights: the same width, depth, heads, MLP
/// width, tying and position table (`n_positions` rows; `seq_len ≤ n_positions`); `vocab ≥` the
/// file's (extra rows start at zero).
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
    if g.positions() != c.n_positions {
        return bad(format!(
            "the model's position table has {} rows, the checkpoint's n_positions is {}",
            g.positions(),
            c.n_positions
        ));
    }
    let inner = c.n_inner.unwrap_or(4 * c.d_model);
    if g.inner() != inner {
        return bad(format!(
            "the model's MLP is {} wide, the checkpoint's {inner} (n_inner)",
            g.inner()
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
/// `model.safetensors` and `config.json` (`source`: the `--init-from` config whose carried keys
/// it keeps), each written to a temporary name and renamed.
///
/// # Errors
/// [`HfError::Io`], [`HfError::Format`], [`HfError::Model`].
pub fn write_dir(
    full: &FullStateDict,
    g: &GptConfig,
    source: Option<&HfConfig>,
    dir: &Path,
) -> Result<(), HfError> {
    let tensors = to_hf(full, g).map_err(|detail| HfError::Model {
        path: dir.to_path_buf(),
        detail,
    })?;
    let config = HfConfig::to_json(g, source);
    write_model_dir(dir, tensors, &config)
}

/// `--export-hf DIR`: gathers the parameters of the wrapped `nn::Gpt` of config `g` to rank 0
/// and writes them there (a collective: every rank calls it; only rank 0 of the shard group
/// writes), with `source`'s carried configuration keys.
///
/// # Errors
/// State-dict errors of the gather; [`write_dir`]'s on the writing rank.
pub fn export<M: Module + 'static>(
    fsdp: &Fsdp<M>,
    g: &GptConfig,
    source: Option<&HfConfig>,
    dir: &Path,
) -> Result<(), HfError> {
    let full = state_dict::full_state_dict(fsdp, true).map_err(|e| HfError::StateDict {
        context: format!("--export-hf {}: gathering the parameters", dir.display()),
        source: Box::new(e),
    })?;
    if full.is_empty() {
        return Ok(());
    }
    write_dir(&full, g, source, dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;
    use std::sync::Arc;

    use fsdp_alloc::Device;
    use fsdp_autograd::nn::{Gelu, Gpt};
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
            crate::hf::assert_logits_close(act, got, v, &ids, w);
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
            let src = HfConfig::read_beside(&fixture()).unwrap();
            export(fsdp, &g, Some(&src), &d2).unwrap();
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
        assert!(e.contains("model_type is \"llama\""), "{e}");
    }

    fn variants_dir() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpt2-variants")
    }

    /// `got` (all `vocab` logits per position) against transformers' `want` (`logits`: every
    /// `ids` of each position; `logsumexp`): each logit within 1e-5 (absolute; measured: at most
    /// 1.5e-6), and the full-vocab log-sum-exp within 1e-5 (absolute).
    fn assert_logits_match(tag: &str, got: &[f32], vocab: usize, ids: &[usize], want: &Value) {
        for (t, row) in want["logits"].as_array().unwrap().iter().enumerate() {
            let row: Vec<f64> = row
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            let mine = &got[t * vocab..(t + 1) * vocab];
            for (k, &id) in ids.iter().enumerate() {
                let err = (mine[id] as f64 - row[k]).abs();
                assert!(
                    err <= 1e-5,
                    "{tag}: position {t} id {id}: {} vs {} (off by {err:e})",
                    mine[id],
                    row[k]
                );
            }
            let m = mine.iter().fold(f64::MIN, |m, &x| m.max(x as f64));
            let lse = m + mine.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
            let want_lse = want["logsumexp"][t].as_f64().unwrap();
            assert!(
                (lse - want_lse).abs() <= 1e-5,
                "{tag}: position {t}: logsumexp {lse} vs {want_lse}"
            );
        }
    }

    /// Every config variant the fixture script made with transformers: written as a model
    /// directory (the variant's config.json and weights), opened through `--init-from`'s code,
    /// loaded on 2 ranks, and its logits compared with transformers' (`scale_attn_weights`,
    /// `scale_attn_by_inverse_layer_idx` and both, `reorder_and_upcast_attn`,
    /// `layer_norm_epsilon`, `n_inner`, every GELU spelling, dropout probabilities (eval: no
    /// effect), an untied head, a tied config whose file carries a distinct head); the
    /// variants train_gpt does not compute (relu, silu, swish, quick_gelu, gelu_10, mish,
    /// add_cross_attention, an unknown key) are refused with one line naming the key.
    #[test]
    fn config_variants_match_transformers_or_are_refused() {
        let text = std::fs::read_to_string(variants_dir().join("variants.json")).unwrap();
        let all: Value = serde_json::from_str(&text).unwrap();
        let tokens: Vec<i64> = all["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_i64().unwrap())
            .collect();
        let ids: Vec<usize> = all["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as usize)
            .collect();
        let tmp = tempfile::tempdir().unwrap();
        let (mut checked, mut refused) = (0, 0);
        for v in all["variants"].as_array().unwrap() {
            let name = v["name"].as_str().unwrap();
            let dir = tmp.path().join(name);
            std::fs::create_dir(&dir).unwrap();
            std::fs::write(dir.join(CONFIG), v["config"].to_string()).unwrap();
            std::fs::copy(
                variants_dir().join(v["weights"].as_str().unwrap()),
                dir.join(WEIGHTS),
            )
            .unwrap();
            if let Some(key) = v["refused"].as_str() {
                let e = HfCheckpoint::open(&dir).unwrap_err().to_string();
                assert!(e.contains(&format!("`{key}`")), "{name}: {e}");
                assert!(!e.contains('\n'), "{name}: {e}");
                refused += 1;
                continue;
            }
            let ck = HfCheckpoint::open(&dir).unwrap();
            let distinct_head = name == "tied_config_distinct_head";
            assert_eq!(ck.note().is_some(), distinct_head, "{name}");
            if distinct_head {
                assert!(!ck.config.tied, "a distinct head unties the model");
            }
            let g = ck.config.gpt();
            let toks = tokens.clone();
            let d = dir.clone();
            let got = on_ranks(2, g, move |dev, fsdp| {
                load_into(
                    fsdp,
                    &HfCheckpoint::open(&d).unwrap(),
                    &fsdp.module().config,
                )
                .unwrap();
                logits(dev, fsdp, &toks)
            });
            assert_eq!(got[0], got[1], "{name}: ranks agree");
            assert_logits_match(name, &got[0], g.vocab, &ids, v);
            checked += 1;
        }
        assert_eq!((checked, refused), (16, 8));
    }

    /// The distinct head is really used: its logits differ from the tied model's, and the
    /// export writes it untied (tie_word_embeddings false, lm_head.weight stored).
    #[test]
    fn a_distinct_head_under_a_tied_config_is_untied_and_exported_so() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("m");
        std::fs::create_dir(&dir).unwrap();
        std::fs::copy(variants_dir().join(CONFIG), dir.join(CONFIG)).unwrap();
        std::fs::copy(variants_dir().join("untied.safetensors"), dir.join(WEIGHTS)).unwrap();
        let ck = HfCheckpoint::open(&dir).unwrap();
        assert!(ck.note().unwrap().contains("loaded untied"));
        let out = tmp.path().join("out");
        let (d, o) = (dir.clone(), out.clone());
        on_ranks(2, ck.config.gpt(), move |_, fsdp| {
            load_into(
                fsdp,
                &HfCheckpoint::open(&d).unwrap(),
                &fsdp.module().config,
            )
            .unwrap();
            let src = HfConfig::read_beside(&d).unwrap();
            export(fsdp, &fsdp.module().config, Some(&src), &o).unwrap();
        });
        let cfg: Value = serde_json::from_slice(&std::fs::read(out.join(CONFIG)).unwrap()).unwrap();
        assert_eq!(cfg["tie_word_embeddings"], false);
        let back = HfCheckpoint::open(&out).unwrap();
        assert!(back.note().is_none() && !back.config.tied);
        let (a, b) = (ck.full_state_dict(), back.full_state_dict());
        assert_eq!(a.get("head.weight"), b.get("head.weight"));
        assert_ne!(
            a.get("head.weight").unwrap().values,
            a.get("tok_emb.weight").unwrap().values
        );
    }

    fn train_config(args: &[&str]) -> crate::job::TrainConfig {
        use clap::Parser;
        let c = crate::cli::Cli::try_parse_from(
            std::iter::once("train_gpt").chain(args.iter().copied()),
        )
        .unwrap()
        .into_config()
        .unwrap();
        crate::interop::prepare(c).unwrap().0
    }

    /// A 64-position model trained at `--seq-len 32` exports its 64-row table and
    /// `n_positions: 64` (transformers can run 64-token inputs); its first 32 rows trained, the
    /// rest as loaded. A model built from scratch exports its own table size.
    #[test]
    fn the_export_keeps_the_whole_position_table() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("hf");
        let src = variants_dir();
        let c = train_config(&[
            "--init-from",
            src.to_str().unwrap(),
            "--seq-len",
            "32",
            "--steps",
            "2",
            "--ranks",
            "2",
            "--batch",
            "1",
            "--lr",
            "0.1",
            "--export-hf",
            out.to_str().unwrap(),
        ]);
        let g = c.model.as_gpt().unwrap();
        assert_eq!((g.seq_len, g.positions()), (32, 64));
        crate::train::run_job(&c, Box::new(crate::job::Quiet), false).unwrap();
        let cfg: Value = serde_json::from_slice(&std::fs::read(out.join(CONFIG)).unwrap()).unwrap();
        assert_eq!(cfg["n_positions"], 64);
        let file = std::fs::read(out.join(WEIGHTS)).unwrap();
        let st = SafeTensors::deserialize(&file).unwrap();
        let wpe = st.tensor("transformer.wpe.weight").unwrap();
        assert_eq!(wpe.shape(), &[64, 32]);
        let orig = std::fs::read(src.join(WEIGHTS)).unwrap();
        let orig = SafeTensors::deserialize(&orig).unwrap();
        let owpe = orig.tensor("transformer.wpe.weight").unwrap();
        let row = 32 * 4;
        assert_ne!(
            &wpe.data()[..32 * row],
            &owpe.data()[..32 * row],
            "rows 0..32 trained"
        );
        assert_eq!(
            &wpe.data()[32 * row..],
            &owpe.data()[32 * row..],
            "rows 32..64 untouched"
        );
        // The config's other keys came along; what the run used was written back.
        assert_eq!(cfg["summary_type"], "cls_index");
        assert_eq!(cfg["resid_pdrop"], json_num(0.1));
        assert_eq!(cfg["activation_function"], "gelu_new");

        let scratch = tmp.path().join("scratch");
        let c = train_config(&[
            "--d-model",
            "16",
            "--layers",
            "1",
            "--heads",
            "2",
            "--seq-len",
            "12",
            "--vocab",
            "40",
            "--steps",
            "1",
            "--ranks",
            "1",
            "--export-hf",
            scratch.to_str().unwrap(),
        ]);
        crate::train::run_job(&c, Box::new(crate::job::Quiet), false).unwrap();
        let back = HfCheckpoint::open(&scratch).unwrap();
        assert_eq!(back.config.n_positions, 12);
        assert_eq!(
            back.config.dropout,
            fsdp_autograd::nn::GptDropout::default()
        );
    }

    fn json_num(x: f64) -> Value {
        serde_json::json!(x)
    }

    /// `--steps 0 --init-from SRC --export-hf OUT` converts without training: every tensor of
    /// OUT is bit for bit SRC's (same names, shapes, F32 bytes) and its config.json has SRC's
    /// keys and values. `--steps 0 --resume --save` writes the checkpoint's parameters.
    #[test]
    fn steps_zero_converts_bit_for_bit() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("hf");
        let src = variants_dir();
        let c = train_config(&[
            "--init-from",
            src.to_str().unwrap(),
            "--steps",
            "0",
            "--ranks",
            "2",
            "--export-hf",
            out.to_str().unwrap(),
        ]);
        let r = crate::train::run_job(&c, Box::new(crate::job::Quiet), false).unwrap();
        assert!(r.steps.is_empty());
        let (a, b) = (
            std::fs::read(src.join(WEIGHTS)).unwrap(),
            std::fs::read(out.join(WEIGHTS)).unwrap(),
        );
        let (a, b) = (
            SafeTensors::deserialize(&a).unwrap(),
            SafeTensors::deserialize(&b).unwrap(),
        );
        let (mut na, mut nb) = (a.names(), b.names());
        na.sort();
        nb.sort();
        assert_eq!(na, nb);
        for n in na {
            let (x, y) = (a.tensor(n).unwrap(), b.tensor(n).unwrap());
            assert_eq!((x.shape(), x.dtype()), (y.shape(), y.dtype()), "{n}");
            assert!(x.data() == y.data(), "{n} differs");
        }
        let read = |d: &Path| -> Value {
            serde_json::from_slice(&std::fs::read(d.join(CONFIG)).unwrap()).unwrap()
        };
        assert_eq!(read(&src), read(&out));

        // A checkpoint converted: --resume --steps 0 --save writes its parameters.
        let ck = tmp.path().join("ck");
        let small = [
            "--d-model",
            "16",
            "--layers",
            "1",
            "--heads",
            "2",
            "--seq-len",
            "8",
            "--vocab",
            "40",
            "--ranks",
            "2",
            "--checkpoint-dir",
        ];
        let mut a1 = small.to_vec();
        a1.extend([ck.to_str().unwrap(), "--steps", "2"]);
        let trained = crate::train::run_job(&train_config(&a1), Box::new(crate::job::Quiet), true)
            .unwrap()
            .final_params
            .unwrap();
        let saved = tmp.path().join("saved.safetensors");
        let mut a2 = small.to_vec();
        a2.extend([ck.to_str().unwrap(), "--steps", "0", "--resume", "--save"]);
        a2.push(saved.to_str().unwrap());
        crate::train::run_job(&train_config(&a2), Box::new(crate::job::Quiet), false).unwrap();
        let loaded = fsdp_core::state_dict::FullStateDict::load(&saved).unwrap();
        for e in &trained.entries {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&loaded.get(&e.name).unwrap().values),
                bits(&e.values),
                "{}",
                e.name
            );
        }
    }
}
