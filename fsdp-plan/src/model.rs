//! The model as the planner sees it: FSDP units (parameter counts) and the forward execution
//! sequence of leaf modules (FLOPs and saved activation bytes per token), with a constructor that
//! derives both from a [`GptConfig`] and a [`WrapPolicy`] through the same unit planning
//! [`fsdp_core::Fsdp::wrap`] uses ([`plan_units`]).

use fsdp_autograd::nn::GptConfig;

use crate::error::PlanError;
use fsdp_core::wrap::{plan_units, ModuleInfo, WrapPolicy};

/// One FSDP unit: what it gathers and reduces.
#[derive(Debug, Clone, PartialEq)]
pub struct UnitDesc {
    /// Module path of the unit ("" for the root), as [`fsdp_core::UnitInfo::path`].
    pub path: String,
    /// Parameter elements of the unit (no padding; shared parameters counted once).
    pub numel: usize,
}

/// One leaf computation of the forward pass, in execution order. Its parameters belong to
/// `unit`; while it runs, that unit (and every unit enclosing it) is unsharded.
#[derive(Debug, Clone, PartialEq)]
pub struct Leaf {
    /// Module path (e.g. `blocks.0.mlp.fc`), or `loss` for the loss after the model.
    pub path: String,
    /// Index into [`ModelDesc::units`] of the unit owning the leaf's parameters (for a leaf
    /// without parameters: the deepest unit enclosing it).
    pub unit: usize,
    /// Forward FLOPs per token; backward is counted as twice this.
    pub fwd_flops_per_token: f64,
    /// Bytes per token the leaf allocates in forward and keeps until its backward ran (saved
    /// tensors and the output the next leaf saves).
    pub saved_bytes_per_token: f64,
    /// Bytes per token briefly allocated on top while the leaf's backward runs (the gradient
    /// of its output and of its saved tensors).
    pub bwd_transient_bytes_per_token: f64,
    /// Bytes of the parameter gradients the leaf computes before folding them into the unit's
    /// flat gradient (a temporary); 0 exactly when the leaf has no parameters.
    pub weight_grad_bytes: usize,
    /// Device-memory bytes per token the leaf's forward reads and writes (activations, not the
    /// weights); backward is counted as twice this. Only a [`crate::Hardware`] roofline
    /// uses it (a memory-bound leaf — layer norm, GELU, softmax — costs `bytes / HBM
    /// bandwidth`); 0 when unknown.
    pub hbm_bytes_per_token: f64,
}

/// A model description: units, the forward sequence of leaves, element sizes.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelDesc {
    /// A short name for tables (e.g. `gpt d256 L4`).
    pub name: String,
    /// Units in [`plan_units`] order (root first), as [`fsdp_core::Fsdp::units`] lists them.
    pub units: Vec<UnitDesc>,
    /// Forward execution order of the leaves; backward runs them in reverse.
    pub leaves: Vec<Leaf>,
    /// For each unit, the leaf range `[first, last]` its module encloses (its forward runs from
    /// the first's start to the last's end). The root encloses everything.
    pub spans: Vec<(usize, usize)>,
    /// Bytes per parameter element of the stored (sharded) parameters, gradients and optimizer
    /// slots: 4 (f32).
    pub param_bytes: usize,
    /// Bytes per element of the unsharded (gathered) parameters and their flat gradient: 4 for
    /// f32, 2 under bf16/f16 mixed precision.
    pub compute_bytes: usize,
    /// Bytes per token of the step's inputs (token ids and targets), held for the whole step.
    pub input_bytes_per_token: f64,
    /// Bytes per token of the model's output (the logits), allocated by the root's last leaf
    /// and held by the training loop until the step ends (it outlives its saved uses).
    pub output_bytes_per_token: f64,
    /// Tokens per sequence the activation figures assume (attention scores grow with it).
    pub seq_len: usize,
}

impl ModelDesc {
    /// Total parameter elements (Ψ, no padding).
    pub fn numel(&self) -> usize {
        self.units.iter().map(|u| u.numel).sum()
    }

    /// Forward FLOPs per token of the whole model (the loss included).
    pub fn fwd_flops_per_token(&self) -> f64 {
        self.leaves.iter().map(|l| l.fwd_flops_per_token).sum()
    }

    /// Forward + backward FLOPs per token (3× forward).
    pub fn train_flops_per_token(&self) -> f64 {
        3.0 * self.fwd_flops_per_token()
    }

    /// Index of the root unit (path "").
    pub fn root(&self) -> usize {
        self.units
            .iter()
            .position(|u| u.path.is_empty())
            .unwrap_or(0)
    }

    /// Checks the description is usable: units and leaves exist, every leaf names a unit,
    /// spans are in range.
    pub fn validate(&self) -> Result<(), PlanError> {
        let bad = |m: String| Err(PlanError::Model(m));
        if self.units.is_empty() || self.leaves.is_empty() {
            return bad("the model needs at least one unit and one leaf".into());
        }
        if self.spans.len() != self.units.len() {
            return bad(format!(
                "{} spans for {} units; give one leaf range per unit",
                self.spans.len(),
                self.units.len()
            ));
        }
        for l in &self.leaves {
            if l.unit >= self.units.len() {
                return bad(format!(
                    "leaf `{}` names unit {} of {}",
                    l.path,
                    l.unit,
                    self.units.len()
                ));
            }
            let finite = [
                l.fwd_flops_per_token,
                l.saved_bytes_per_token,
                l.bwd_transient_bytes_per_token,
                l.hbm_bytes_per_token,
            ];
            if finite.iter().any(|x| !x.is_finite() || *x < 0.0) {
                return bad(format!(
                    "leaf `{}` has a negative or non-finite figure",
                    l.path
                ));
            }
        }
        for (u, &(a, b)) in self.spans.iter().enumerate() {
            if a > b || b >= self.leaves.len() {
                return bad(format!(
                    "unit {u} has the leaf range {a}..={b} out of range"
                ));
            }
        }
        if ![2, 4].contains(&self.compute_bytes) || self.param_bytes != 4 {
            return bad("parameters are stored in f32 (4 bytes) and computed in 4 or 2".into());
        }
        Ok(())
    }

    /// The description of a [`fsdp_autograd::nn::Gpt`] with `cfg`, wrapped by `policy`:
    /// the module tree `Gpt` builds (same paths, type names and parameter sizes, the tied head
    /// included), planned by [`plan_units`] as `Fsdp::wrap` does, with per-token FLOPs and
    /// activation bytes of fsdp-autograd's kernels (what each op saves for backward, f32).
    pub fn gpt(cfg: &GptConfig, policy: &WrapPolicy) -> Result<ModelDesc, PlanError> {
        if cfg.vocab == 0 || cfg.d_model == 0 || cfg.n_heads == 0 || cfg.seq_len == 0 {
            return Err(PlanError::Model(format!("{cfg:?}: sizes must be positive")));
        }
        if cfg.d_model % cfg.n_heads != 0 {
            return Err(PlanError::Model(format!(
                "d_model {} is not divisible by n_heads {}",
                cfg.d_model, cfg.n_heads
            )));
        }
        let name = format!(
            "gpt v{} d{} L{} h{} t{}{}",
            cfg.vocab,
            cfg.d_model,
            cfg.n_layers,
            cfg.n_heads,
            cfg.seq_len,
            if cfg.tied { " tied" } else { "" }
        );
        ModelDesc::from_tree(
            name,
            &gpt_modules(cfg),
            gpt_leaves(cfg),
            policy,
            cfg.vocab,
            cfg.seq_len,
        )
    }

    /// A description from a model's module tree (`infos`, pre-order as `Fsdp::wrap` sees it) and
    /// its forward leaves (path, forward FLOPs/token, saved bytes/token, backward transient
    /// bytes/token, weight-gradient bytes, activation traffic bytes/token), planned by
    /// [`plan_units`] with `policy`: f32 parameters, i64 ids and targets, f32 logits of `vocab`.
    /// A leaf belongs to the unit owning its module's first parameter, else to the deepest unit
    /// enclosing its path.
    pub(crate) fn from_tree(
        name: String,
        infos: &[ModuleInfo],
        leaves: Vec<(String, f64, f64, f64, usize, f64)>,
        policy: &WrapPolicy,
        vocab: usize,
        seq_len: usize,
    ) -> Result<ModelDesc, PlanError> {
        let plans = plan_units(infos, policy).map_err(|e| PlanError::Model(e.to_string()))?;
        let units: Vec<UnitDesc> = plans
            .iter()
            .map(|p| UnitDesc {
                path: p.path.clone(),
                numel: p.params.iter().map(|x| x.2).sum(),
            })
            .collect();
        // Which unit owns a module's parameters (for a module without its own: the deepest
        // unit enclosing it).
        let owner_of_param = |id: usize| {
            plans
                .iter()
                .position(|p| p.params.iter().any(|x| x.1 == id))
        };
        let enclosing = |path: &str| {
            plans
                .iter()
                .enumerate()
                .filter(|(_, p)| {
                    p.path.is_empty() || path == p.path || path.starts_with(&format!("{}.", p.path))
                })
                .max_by_key(|(_, p)| p.path.len())
                .map(|(i, _)| i)
                .unwrap_or(0)
        };
        let leaves: Vec<Leaf> = leaves
            .into_iter()
            .map(|(path, fl, saved, tr, wgrad, hbm)| {
                let module = infos.iter().find(|m| m.path == path);
                let unit = module
                    .and_then(|m| m.params.first())
                    .and_then(|p| owner_of_param(p.1))
                    .unwrap_or_else(|| enclosing(&path));
                Leaf {
                    path,
                    unit,
                    fwd_flops_per_token: fl,
                    saved_bytes_per_token: saved,
                    bwd_transient_bytes_per_token: tr,
                    weight_grad_bytes: wgrad,
                    hbm_bytes_per_token: hbm,
                }
            })
            .collect();
        let spans = plans
            .iter()
            .map(|p| {
                // The root's forward ends with the model's output: the loss comes after it.
                let inside = |l: &Leaf| {
                    (p.path.is_empty() && l.path != "loss")
                        || l.path == p.path
                        || l.path.starts_with(&format!("{}.", p.path))
                };
                let first = leaves.iter().position(inside).unwrap_or(0);
                let last = leaves.iter().rposition(inside).unwrap_or(first);
                (first, last)
            })
            .collect();
        let d = ModelDesc {
            name,
            units,
            leaves,
            spans,
            param_bytes: 4,
            compute_bytes: 4,
            // i64 token ids and i64 targets.
            input_bytes_per_token: 16.0,
            // f32 logits.
            output_bytes_per_token: 4.0 * vocab as f64,
            seq_len,
        };
        d.validate()?;
        Ok(d)
    }

    /// This description with unsharded parameters and flat gradients in a 2-byte dtype
    /// (bf16/f16 mixed precision). Activations keep their f32 figures (fsdp-autograd computes
    /// in the parameter dtype, so this overstates them slightly).
    pub fn with_compute_bytes(mut self, bytes: usize) -> ModelDesc {
        self.compute_bytes = bytes;
        self
    }

    /// This description with activations (saved tensors, backward temporaries, the output and
    /// the activation traffic) in elements of `bytes` instead of the 4 of f32: 2 for a model
    /// that computes in bf16/f16 (as PyTorch autocast does). Inputs (token ids) are unchanged.
    pub fn with_activation_bytes(mut self, bytes: usize) -> ModelDesc {
        let k = bytes as f64 / 4.0;
        for l in &mut self.leaves {
            l.saved_bytes_per_token *= k;
            l.bwd_transient_bytes_per_token *= k;
            l.hbm_bytes_per_token *= k;
        }
        self.output_bytes_per_token *= k;
        self
    }

    /// The units that enclose no other unit (the leaves of the unit tree; the root excepted
    /// unless it is the only unit): what activation checkpointing per block recomputes.
    pub fn innermost_units(&self) -> Vec<usize> {
        let n = self.units.len();
        (0..n)
            .filter(|&u| {
                (n == 1 || u != self.root())
                    && (0..n).all(|v| {
                        v == u
                            || !(self.spans[u].0 <= self.spans[v].0
                                && self.spans[v].1 <= self.spans[u].1)
                    })
            })
            .collect()
    }
}

pub(crate) fn module(path: &str, ty: &str, params: &[(&str, usize, usize)]) -> ModuleInfo {
    ModuleInfo {
        path: path.to_string(),
        type_name: ty.to_string(),
        params: params
            .iter()
            .map(|(n, id, k)| (n.to_string(), *id, *k))
            .collect(),
    }
}

/// The module tree of `Gpt::new(cfg)` in pre-order, as `Fsdp::wrap` describes it (parameter
/// identities numbered in visit order; the tied head reuses the token embedding's).
pub fn gpt_modules(cfg: &GptConfig) -> Vec<ModuleInfo> {
    let (v, d, t, inner) = (cfg.vocab, cfg.d_model, cfg.positions(), cfg.inner());
    let mut id = 0usize;
    let mut next = || {
        id += 1;
        id - 1
    };
    let mut out = vec![module("", "Gpt", &[])];
    let tok = next();
    out.push(module("tok_emb", "Embedding", &[("weight", tok, v * d)]));
    out.push(module("pos_emb", "Embedding", &[("weight", next(), t * d)]));
    out.push(module("blocks", "Sequential", &[]));
    for i in 0..cfg.n_layers {
        let b = format!("blocks.{i}");
        out.push(module(&b, "Block", &[]));
        out.push(module(
            &format!("{b}.ln1"),
            "LayerNorm",
            &[("weight", next(), d), ("bias", next(), d)],
        ));
        out.push(module(&format!("{b}.attn"), "CausalSelfAttention", &[]));
        out.push(module(
            &format!("{b}.attn.qkv"),
            "Linear",
            &[("weight", next(), 3 * d * d), ("bias", next(), 3 * d)],
        ));
        out.push(module(
            &format!("{b}.attn.proj"),
            "Linear",
            &[("weight", next(), d * d), ("bias", next(), d)],
        ));
        out.push(module(
            &format!("{b}.ln2"),
            "LayerNorm",
            &[("weight", next(), d), ("bias", next(), d)],
        ));
        out.push(module(&format!("{b}.mlp"), "Mlp", &[]));
        out.push(module(
            &format!("{b}.mlp.fc"),
            "Linear",
            &[("weight", next(), inner * d), ("bias", next(), inner)],
        ));
        out.push(module(
            &format!("{b}.mlp.proj"),
            "Linear",
            &[("weight", next(), inner * d), ("bias", next(), d)],
        ));
    }
    out.push(module(
        "ln_f",
        "LayerNorm",
        &[("weight", next(), d), ("bias", next(), d)],
    ));
    let head = if cfg.tied { tok } else { next() };
    out.push(module("head", "Linear", &[("weight", head, v * d)]));
    out
}

/// (path, forward FLOPs/token, saved bytes/token, backward transient bytes/token, weight
/// gradient bytes, forward activation traffic bytes/token) for every leaf of the GPT forward, in
/// order. The traffic counts each activation read and written once per op (f32), attention as
/// an unfused kernel that writes the `[h, t]` scores per token, reads and writes them in the
/// softmax and reads the probabilities for the value product (four passes).
///
/// A saved tensor is charged to the op that saves it (fsdp-autograd's ops, f32): a linear
/// saves its input; layer norm its input plus mean and rstd; attention q, k, v (views of one
/// contiguous `[3, b, h, t, dh]` copy of the qkv output) and its `[b, h, t, t]` probabilities;
/// GELU its input; cross-entropy the log-sum-exp (the logits are the model's output). It is
/// freed when that op's backward has run. The backward transient is what exists on top while
/// the op's backward runs: the gradient of its output, the gradient of its input, the
/// residual stream's gradient (held while a block's branch is differentiated) and the op's own
/// temporaries.
fn gpt_leaves(cfg: &GptConfig) -> Vec<(String, f64, f64, f64, usize, f64)> {
    let (v, d, h, t) = (
        cfg.vocab as f64,
        cfg.d_model as f64,
        cfg.n_heads as f64,
        cfg.seq_len as f64,
    );
    // The MLP's hidden width and the position table's rows.
    let (m, pos) = (cfg.inner() as f64, cfg.positions() as f64);
    let f = 4.0; // f32
    let bytes = |n: f64| n as usize * 4;
    let mut out = Vec::new();
    // Embeddings: token + position lookups summed into x0; dense weight gradients.
    out.push((
        "tok_emb".to_string(),
        d,
        0.0,
        f * d,
        bytes(v * d),
        f * 2.0 * d,
    ));
    out.push((
        "pos_emb".to_string(),
        d,
        0.0,
        f * d,
        bytes(pos * d),
        f * 3.0 * d,
    ));
    for i in 0..cfg.n_layers {
        let b = format!("blocks.{i}");
        let ln = bytes(2.0 * d);
        // ln1 saves the block input, mean, rstd; backward: output and input gradients, the
        // residual gradient and their sum.
        out.push((
            format!("{b}.ln1"),
            8.0 * d,
            f * d + 8.0,
            4.0 * f * d,
            ln,
            f * 2.0 * d,
        ));
        // qkv saves ln1's output.
        out.push((
            format!("{b}.attn.qkv"),
            2.0 * d * 3.0 * d,
            f * d,
            f * (3.0 * d + d + d),
            bytes(3.0 * d * d + 3.0 * d),
            f * 4.0 * d,
        ));
        // attention saves the contiguous q, k, v copy and the probabilities; backward holds
        // dq, dk, dv and the probabilities' gradient, then their concatenation.
        out.push((
            format!("{b}.attn"),
            2.0 * t * d + 5.0 * h * t,
            f * 3.0 * d + f * h * t,
            (f * (5.0 * d) + f * h * t).max(f * 7.0 * d),
            0,
            f * (7.0 * d + 4.0 * h * t),
        ));
        // proj saves attention's output ([b, t, d] copy); the residual add saves nothing.
        out.push((
            format!("{b}.attn.proj"),
            2.0 * d * d + d,
            f * d,
            f * 2.0 * d,
            bytes(d * d + d),
            f * 5.0 * d,
        ));
        out.push((
            format!("{b}.ln2"),
            8.0 * d,
            f * d + 8.0,
            4.0 * f * d,
            ln,
            f * 2.0 * d,
        ));
        // fc saves ln2's output; GELU saves fc's output; proj saves GELU's output.
        out.push((
            format!("{b}.mlp.fc"),
            2.0 * d * m,
            f * d,
            f * (m + d + d),
            bytes(m * d + m),
            f * (d + m),
        ));
        out.push((
            format!("{b}.mlp.gelu"),
            10.0 * m,
            f * m,
            f * (m + m + d),
            0,
            f * 2.0 * m,
        ));
        out.push((
            format!("{b}.mlp.proj"),
            2.0 * m * d + d,
            f * m,
            f * (d + m),
            bytes(m * d + d),
            f * 8.0 * d,
        ));
    }
    out.push((
        "ln_f".to_string(),
        8.0 * d,
        f * d + 8.0,
        3.0 * f * d,
        bytes(2.0 * d),
        f * 2.0 * d,
    ));
    // The head saves ln_f's output; its output (the logits) is the model's output.
    out.push((
        "head".to_string(),
        2.0 * d * v,
        f * d,
        f * v + f * d,
        bytes(v * d),
        f * (d + v),
    ));
    // Cross-entropy saves the log-sum-exp; its backward allocates the logits' gradient.
    out.push(("loss".to_string(), 5.0 * v, 4.0, f * v, 0, f * 2.0 * v));
    out
}
