//! Modules: the [`Module`] trait (forward, parameter and child visitors, forward hooks), the
//! name-resolving helpers [`named_parameters`] / [`named_modules`], and layers up to a small GPT
//! and a Llama.
//!
//! Parents call children through [`Module::call`], which runs the child's forward pre-hooks,
//! its `forward`, then its forward hooks — the points where FSDP unshards a unit before its
//! forward and reshards / registers its pre-backward hooks after it.
//!
//! ```
//! use std::sync::{Arc, Mutex};
//! use fsdp_alloc::{DType, Device};
//! use fsdp_autograd::nn::{named_parameters, Linear, Module};
//! use fsdp_autograd::{InitContext, Tensor};
//!
//! let dev = Device::cpu(0);
//! let fc = Linear::new(&InitContext::eager(&dev, 0).child("fc"), 4, 2, true)?;
//! let names: Vec<String> = named_parameters(&fc).into_iter().map(|(n, _)| n).collect();
//! assert_eq!(names, ["weight", "bias"]); // relative to the module visited
//!
//! let log = Arc::new(Mutex::new(Vec::new()));
//! let l = log.clone();
//! fc.hooks().register_forward_pre_hook(move |_| { l.lock().unwrap().push("pre"); Ok(None) });
//! let l = log.clone();
//! fc.hooks().register_forward_hook(move |_, _| { l.lock().unwrap().push("post"); Ok(None) });
//! let y = fc.call(&Tensor::ones(&[3, 4], DType::F32, &dev)?)?;
//! assert_eq!(y.shape(), &[3, 2]);
//! assert_eq!(*log.lock().unwrap(), ["pre", "post"]);
//! # Ok::<(), fsdp_autograd::AutogradError>(())
//! ```

mod gpt;
mod layers;
mod llama;

/// The GELU variants an [`Mlp`] (and [`GptConfig::gelu`]) can use.
pub use crate::kernels::Gelu;
pub use gpt::{AttnScaling, Block, CausalSelfAttention, Gpt, GptConfig, GptDropout, Mlp};
pub use layers::{Embedding, LayerNorm, Linear, RmsNorm, Sequential};
pub use llama::{
    rope_inv_freq, Llama, Llama3Scaling, LlamaAttention, LlamaConfig, LlamaDecoderLayer,
    LlamaLayers, LlamaMlp, RotaryTables,
};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::Result;
use crate::param::Parameter;
use crate::tensor::Tensor;

/// A forward pre-hook: sees the module's input; `Some(x)` replaces it.
pub type ForwardPreHook = Arc<dyn Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync>;
/// A forward hook: sees the module's input and output; `Some(y)` replaces the output.
pub type ForwardHook = Arc<dyn Fn(&Tensor, &Tensor) -> Result<Option<Tensor>> + Send + Sync>;

static NEXT_MODULE_HOOK: AtomicU64 = AtomicU64::new(1);

/// Identifies a registered module hook (for [`ModuleHooks::remove`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ModuleHookId(u64);

/// The forward hooks of one module (every module owns one).
#[derive(Default)]
pub struct ModuleHooks {
    pre: Mutex<Vec<(ModuleHookId, ForwardPreHook)>>,
    post: Mutex<Vec<(ModuleHookId, ForwardHook)>>,
}

impl std::fmt::Debug for ModuleHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModuleHooks")
            .field("pre", &self.pre.lock().map(|v| v.len()).unwrap_or(0))
            .field("post", &self.post.lock().map(|v| v.len()).unwrap_or(0))
            .finish()
    }
}

impl ModuleHooks {
    /// No hooks.
    pub fn new() -> ModuleHooks {
        ModuleHooks::default()
    }

    /// Registers a hook run before `forward` (in registration order); `Ok(Some(x))` replaces
    /// the input.
    pub fn register_forward_pre_hook(
        &self,
        f: impl Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync + 'static,
    ) -> ModuleHookId {
        let id = ModuleHookId(NEXT_MODULE_HOOK.fetch_add(1, Ordering::Relaxed));
        self.pre
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((id, Arc::new(f)));
        id
    }

    /// Registers a hook run after `forward` with (input, output) (in registration order);
    /// `Ok(Some(y))` replaces the output.
    pub fn register_forward_hook(
        &self,
        f: impl Fn(&Tensor, &Tensor) -> Result<Option<Tensor>> + Send + Sync + 'static,
    ) -> ModuleHookId {
        let id = ModuleHookId(NEXT_MODULE_HOOK.fetch_add(1, Ordering::Relaxed));
        self.post
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((id, Arc::new(f)));
        id
    }

    /// Removes a hook; `false` if it was not registered here.
    pub fn remove(&self, id: ModuleHookId) -> bool {
        let mut pre = self.pre.lock().unwrap_or_else(|e| e.into_inner());
        let n = pre.len();
        pre.retain(|(i, _)| *i != id);
        if pre.len() != n {
            return true;
        }
        let mut post = self.post.lock().unwrap_or_else(|e| e.into_inner());
        let n = post.len();
        post.retain(|(i, _)| *i != id);
        post.len() != n
    }

    /// Removes every hook.
    pub fn clear(&self) {
        self.pre.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.post.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// Runs the pre-hooks on `x`, returning the (possibly replaced) input.
    pub fn run_pre(&self, x: &Tensor) -> Result<Tensor> {
        let hooks: Vec<ForwardPreHook> = self
            .pre
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(_, h)| Arc::clone(h))
            .collect();
        let mut x = x.clone();
        for h in hooks {
            if let Some(new) = h(&x)? {
                x = new;
            }
        }
        Ok(x)
    }

    /// Runs the forward hooks on (`input`, `output`), returning the (possibly replaced) output.
    pub fn run_post(&self, input: &Tensor, output: Tensor) -> Result<Tensor> {
        let hooks: Vec<ForwardHook> = self
            .post
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(_, h)| Arc::clone(h))
            .collect();
        let mut y = output;
        for h in hooks {
            if let Some(new) = h(input, &y)? {
                y = new;
            }
        }
        Ok(y)
    }
}

/// A neural-network module. Object safe: models are trees of `dyn Module`.
pub trait Module: Send + Sync {
    /// The computation (call children through [`Module::call`]).
    fn forward(&self, x: &Tensor) -> Result<Tensor>;

    /// Visits this module's *direct* parameters with their local names, in a fixed order.
    fn visit_params(&self, f: &mut dyn FnMut(&str, &Parameter));

    /// Visits the direct children with their local names, in a fixed order.
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(&str, &'a dyn Module));

    /// A short type name (e.g. `"Linear"`), for wrap policies and messages.
    fn type_name(&self) -> &'static str;

    /// This module's forward hooks.
    fn hooks(&self) -> &ModuleHooks;

    /// Runs the forward pre-hooks, [`Module::forward`], then the forward hooks.
    fn call(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.hooks().run_pre(x)?;
        let y = self.forward(&x)?;
        self.hooks().run_post(&x, y)
    }
}

fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

fn collect_params(m: &dyn Module, prefix: &str, out: &mut Vec<(String, Parameter)>, dedup: bool) {
    m.visit_params(&mut |name, p| {
        if !(dedup && out.iter().any(|(_, q)| q.ptr_eq(p))) {
            out.push((join(prefix, name), p.clone()));
        }
    });
    m.visit_children(&mut |name, c| collect_params(c, &join(prefix, name), out, dedup));
}

/// Every parameter of the tree with its fully-qualified name (depth-first: a module's own
/// parameters, then its children's, in visiting order). A parameter reachable from several
/// modules (tied) is listed once, under its first name.
pub fn named_parameters(m: &dyn Module) -> Vec<(String, Parameter)> {
    let mut out = Vec::new();
    collect_params(m, "", &mut out, true);
    out
}

/// Like [`named_parameters`] but lists shared parameters under every name they are reachable
/// by (detect sharing with [`Parameter::ptr_eq`]).
pub fn named_parameters_with_duplicates(m: &dyn Module) -> Vec<(String, Parameter)> {
    let mut out = Vec::new();
    collect_params(m, "", &mut out, false);
    out
}

/// The parameters of the tree (deduplicated, in [`named_parameters`] order).
pub fn parameters(m: &dyn Module) -> Vec<Parameter> {
    named_parameters(m).into_iter().map(|(_, p)| p).collect()
}

/// Every module of the tree with its fully-qualified name (the root is `""`), pre-order.
pub fn named_modules(m: &dyn Module) -> Vec<(String, &dyn Module)> {
    fn go<'a>(m: &'a dyn Module, prefix: String, out: &mut Vec<(String, &'a dyn Module)>) {
        out.push((prefix.clone(), m));
        let mut kids: Vec<(String, &'a dyn Module)> = Vec::new();
        m.visit_children(&mut |name, c| kids.push((join(&prefix, name), c)));
        for (name, c) in kids {
            go(c, name, out);
        }
    }
    let mut out = Vec::new();
    go(m, String::new(), &mut out);
    out
}

/// Clears the gradients of every materialized parameter of the tree.
pub fn zero_grad(m: &dyn Module) {
    for p in parameters(m) {
        if let Some(t) = p.try_get() {
            t.zero_grad();
        }
    }
}
