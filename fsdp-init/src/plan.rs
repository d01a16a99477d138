//! [`InitPlan`]: every parameter of a model by name, and how each one's values are computed from
//! its recorded init ops (the *recipe*), including `CopyFrom` chains across parameters.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use fsdp_alloc::DType;
use fsdp_autograd::init::{apply_positionwise, fill_whole, last_overwrite, InitError, InitOp};
use fsdp_autograd::nn::{parameters, Module};
use fsdp_autograd::Parameter;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::error::{MaterializeError, Result};

/// What the values of a parameter start from before its effective ops run.
pub(crate) enum Base {
    /// No op overwrites: the ops run on zeros.
    Zeros,
    /// The first effective op overwrites every element (fill, a random op).
    Generated,
    /// The first effective op copies this source's values (rounded to the source's dtype, as an
    /// eager init reads the source tensor).
    Copy(Arc<Recipe>),
}

/// How to compute one parameter's values: its ops from the last overwriting op on.
pub(crate) struct Recipe {
    pub name: String,
    pub seed: u64,
    pub shape: Vec<usize>,
    pub numel: usize,
    pub dtype: DType,
    pub ops: Vec<InitOp>,
    /// First op to apply after the base (ops before it cannot affect the values).
    pub from: usize,
    pub base: Base,
    /// True if every value can be computed for any element range alone: no whole-tensor op
    /// (`Orthogonal`, `Custom`) among the effective ops of this parameter or of its copy sources.
    pub positionwise: bool,
}

impl Recipe {
    /// The copy source, if the values start from one.
    pub fn source(&self) -> Option<&Arc<Recipe>> {
        match &self.base {
            Base::Copy(s) => Some(s),
            _ => None,
        }
    }

    /// The first whole-tensor op among the effective ops (for messages).
    pub fn first_whole_op(&self) -> Option<String> {
        self.ops[self.from..]
            .iter()
            .find(|o| !o.is_positionwise())
            .map(InitOp::describe)
    }

    /// Values of elements `[start, start + out.len())`. Needs `positionwise`.
    pub fn eval_range(&self, start: usize, out: &mut [f32]) -> std::result::Result<(), InitError> {
        match &self.base {
            Base::Zeros => out.fill(0.0),
            Base::Generated => {}
            Base::Copy(s) => {
                s.eval_range(start, out)?;
                round_to(s.dtype, out);
            }
        }
        apply_positionwise(
            &self.ops,
            self.from,
            self.seed,
            &self.name,
            &self.shape,
            start,
            out,
        )
    }

    /// All values (in `f32`, before rounding to the parameter's dtype). Bitwise equal to what
    /// an eager [`fsdp_autograd::InitContext`] computes with `fill_whole`.
    pub fn eval_whole(&self, out: &mut [f32]) -> std::result::Result<(), InitError> {
        if self.positionwise {
            return self.eval_range(0, out);
        }
        let mut resolve = |name: &str| -> std::result::Result<Vec<f32>, InitError> {
            match &self.base {
                Base::Copy(s) if s.name == name => {
                    let mut v = vec![0.0f32; s.numel];
                    s.eval_whole(&mut v)?;
                    round_to(s.dtype, &mut v);
                    Ok(v)
                }
                _ => Err(InitError::Unresolved {
                    source_fqn: name.to_string(),
                    reason: "only the last overwriting CopyFrom of a parameter is resolved".into(),
                }),
            }
        };
        fill_whole(
            &self.ops,
            self.seed,
            &self.name,
            &self.shape,
            out,
            &mut resolve,
        )
    }

    /// Checks every effective op's arguments (and the sources') without computing values.
    pub fn validate(&self) -> std::result::Result<(), InitError> {
        if let Some(s) = self.source() {
            s.validate()?;
        }
        if self.positionwise {
            return self.eval_range(0, &mut []);
        }
        for i in self.from..self.ops.len() {
            if self.ops[i].is_positionwise() {
                apply_positionwise(
                    &self.ops[..=i],
                    i,
                    self.seed,
                    &self.name,
                    &self.shape,
                    0,
                    &mut [],
                )?;
            }
        }
        Ok(())
    }
}

/// Rounds `f32` values to `dtype` and back (what storing in and reading from a tensor of that
/// dtype does), with the same slice conversions the tensors use.
pub(crate) fn round_to(dtype: DType, v: &mut [f32]) {
    match dtype {
        DType::F16 => {
            let mut h = vec![f16::ZERO; v.len()];
            h.convert_from_f32_slice(v);
            h.convert_to_f32_slice(v);
        }
        DType::BF16 => {
            let mut h = vec![bf16::ZERO; v.len()];
            h.convert_from_f32_slice(v);
            h.convert_to_f32_slice(v);
        }
        _ => {}
    }
}

/// A `CopyFrom` edge that leaves a unit, found by [`InitPlan::cross_unit_dependencies`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CrossUnitDependency {
    /// The parameter whose values start from a copy.
    pub param: String,
    /// The source parameter, outside the unit.
    pub source: String,
    /// True if the source's values can be regenerated from its recorded ops for any element
    /// range (no whole-tensor op in its chain), so the copy is replayed; false if materializing
    /// the unit is refused.
    pub replayable: bool,
}

/// Every parameter of a model by fully-qualified name, for resolving `CopyFrom` sources and
/// detecting cross-unit dependencies.
///
/// Parameters are keyed by [`Parameter::name`] (the name they were created with, which is also
/// their RNG key), not by the module path they are reached through, so a tied parameter is one
/// entry.
///
/// ```
/// use fsdp_alloc::{DType, Device};
/// use fsdp_autograd::{init::InitOp, InitContext};
/// use fsdp_init::InitPlan;
///
/// let ctx = InitContext::fake(7);
/// let emb = ctx.param("emb", &[4, 3], DType::F32, vec![InitOp::Normal { mean: 0.0, std: 1.0 }])?;
/// let head = ctx.param("head", &[4, 3], DType::F32, vec![
///     InitOp::CopyFrom { source: "emb".into() }, InitOp::Scale(0.5),
/// ])?;
/// let plan = InitPlan::new(ctx.params())?;
/// // `head` copies from `emb`, which is outside a unit holding only `head`, but position-wise:
/// let deps = plan.cross_unit_dependencies(&[head.clone()])?;
/// assert!(deps[0].replayable);
/// plan.materialize_unit(&[head.clone()], &Device::cpu(0))?;
/// assert!(head.is_materialized() && !emb.is_materialized());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Default)]
pub struct InitPlan {
    params: Vec<Parameter>,
    by_name: HashMap<String, Parameter>,
}

impl std::fmt::Debug for InitPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InitPlan")
            .field("params", &self.params.len())
            .finish()
    }
}

impl InitPlan {
    /// A plan over `params` (duplicates of one parameter are kept once).
    ///
    /// # Errors
    /// [`MaterializeError::DuplicateName`] if two different parameters share a name.
    pub fn new(params: impl IntoIterator<Item = Parameter>) -> Result<InitPlan> {
        let mut plan = InitPlan::default();
        for p in params {
            match plan.by_name.get(p.name()) {
                Some(q) if q.ptr_eq(&p) => {}
                Some(_) => {
                    return Err(MaterializeError::DuplicateName {
                        name: p.name().to_string(),
                    })
                }
                None => {
                    plan.by_name.insert(p.name().to_string(), p.clone());
                    plan.params.push(p);
                }
            }
        }
        Ok(plan)
    }

    /// A plan over every parameter of `model` (tied parameters once).
    ///
    /// # Errors
    /// As [`InitPlan::new`].
    pub fn from_module(model: &dyn Module) -> Result<InitPlan> {
        InitPlan::new(parameters(model))
    }

    /// The parameters, in the order given.
    pub fn params(&self) -> &[Parameter] {
        &self.params
    }

    /// The parameter created with name `fqn`.
    pub fn get(&self, fqn: &str) -> Option<&Parameter> {
        self.by_name.get(fqn)
    }

    /// Number of parameters.
    pub fn len(&self) -> usize {
        self.params.len()
    }

    /// True if the plan holds no parameters.
    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    /// The recipe of `p`, resolving copy sources through the plan.
    pub(crate) fn recipe(&self, p: &Parameter) -> Result<Arc<Recipe>> {
        let mut memo = HashMap::new();
        self.recipe_inner(p, &mut Vec::new(), &mut memo)
    }

    fn recipe_inner(
        &self,
        p: &Parameter,
        stack: &mut Vec<String>,
        memo: &mut HashMap<String, Arc<Recipe>>,
    ) -> Result<Arc<Recipe>> {
        if let Some(r) = memo.get(p.name()) {
            return Ok(Arc::clone(r));
        }
        if let Some(pos) = stack.iter().position(|n| n == p.name()) {
            let mut cycle = stack[pos..].to_vec();
            cycle.push(p.name().to_string());
            return Err(MaterializeError::DependencyCycle { cycle });
        }
        if !p.dtype().is_float() {
            return Err(MaterializeError::UnsupportedDType {
                param: p.name().to_string(),
                dtype: p.dtype(),
            });
        }
        let ops = p.init_ops().to_vec();
        let (base, from) = match last_overwrite(&ops) {
            None => (Base::Zeros, 0),
            Some(k) => match &ops[k] {
                InitOp::CopyFrom { source } => {
                    let src = self.by_name.get(source.as_str()).ok_or_else(|| {
                        MaterializeError::UnknownSource {
                            param: p.name().to_string(),
                            source_param: source.clone(),
                            known: self.params.len(),
                        }
                    })?;
                    if src.numel() != p.numel() {
                        return Err(InitError::CopySizeMismatch {
                            fqn: p.name().to_string(),
                            source_fqn: source.clone(),
                            expected: p.numel(),
                            got: src.numel(),
                        }
                        .into());
                    }
                    stack.push(p.name().to_string());
                    let r = self.recipe_inner(src, stack, memo);
                    stack.pop();
                    (Base::Copy(r?), k + 1)
                }
                _ => (Base::Generated, k),
            },
        };
        let positionwise = ops[from..].iter().all(InitOp::is_positionwise)
            && match &base {
                Base::Copy(s) => s.positionwise,
                _ => true,
            };
        let r = Arc::new(Recipe {
            name: p.name().to_string(),
            seed: p.seed(),
            shape: p.shape().to_vec(),
            numel: p.numel(),
            dtype: p.dtype(),
            ops,
            from,
            base,
            positionwise,
        });
        memo.insert(p.name().to_string(), Arc::clone(&r));
        Ok(r)
    }

    /// Whether `p`'s values can be generated for any element range alone (no whole-tensor op
    /// among its effective ops or its copy sources' effective ops).
    ///
    /// # Errors
    /// Unknown copy sources, cycles.
    pub fn is_positionwise(&self, p: &Parameter) -> Result<bool> {
        Ok(self.recipe(p)?.positionwise)
    }

    /// The `CopyFrom` edges that leave `unit`: for every unmaterialized parameter of the unit,
    /// each link of its effective copy chain whose source is not in the unit.
    ///
    /// Ops before a parameter's last overwriting op do not count (they cannot affect its
    /// values). Sources are always regenerated from their recorded ops, never read from their
    /// current tensor (after FSDP sharding that may be a view of a freed flat parameter).
    ///
    /// # Errors
    /// Unknown copy sources, cycles.
    pub fn cross_unit_dependencies(&self, unit: &[Parameter]) -> Result<Vec<CrossUnitDependency>> {
        let members: HashSet<&str> = unit.iter().map(Parameter::name).collect();
        let mut out = Vec::new();
        let mut seen = HashSet::new();
        for p in unit.iter().filter(|p| !p.is_materialized()) {
            let mut r = self.recipe(p)?;
            while let Some(s) = r.source().cloned() {
                if !members.contains(s.name.as_str())
                    && seen.insert((r.name.clone(), s.name.clone()))
                {
                    out.push(CrossUnitDependency {
                        param: r.name.clone(),
                        source: s.name.clone(),
                        replayable: s.positionwise,
                    });
                }
                r = s;
            }
        }
        Ok(out)
    }

    /// Checks that `unit` can be materialized on its own: every cross-unit copy source is
    /// replayable.
    ///
    /// # Errors
    /// [`MaterializeError::CrossUnitDependency`] naming the first non-replayable edge;
    /// unknown sources, cycles, invalid op arguments.
    pub fn check_unit(&self, unit: &[Parameter]) -> Result<()> {
        for d in self.cross_unit_dependencies(unit)? {
            if !d.replayable {
                let src = self
                    .by_name
                    .get(&d.source)
                    .map(|s| self.recipe(s))
                    .transpose()?;
                let what = src
                    .as_ref()
                    .and_then(|s| {
                        let mut r = Arc::clone(s);
                        loop {
                            if let Some(op) = r.first_whole_op() {
                                return Some(format!("`{}` is initialized by `{op}`", r.name));
                            }
                            r = r.source().cloned()?;
                        }
                    })
                    .unwrap_or_else(|| "its init needs the whole tensor".into());
                return Err(MaterializeError::CrossUnitDependency {
                    param: d.param,
                    source_param: d.source,
                    reason: format!(
                        "{what}, which needs the whole tensor and would rebuild part of another \
                         unit on this rank"
                    ),
                });
            }
        }
        for p in unit.iter().filter(|p| !p.is_materialized()) {
            self.recipe(p)?.validate()?;
        }
        Ok(())
    }

    /// The values eager init gives `p` (whole tensor, rounded to its dtype, as `f32`), computed
    /// on the host from its recorded ops — a reference for tests and debugging.
    ///
    /// # Errors
    /// Unknown sources, cycles, invalid ops.
    pub fn values(&self, p: &Parameter) -> Result<Vec<f32>> {
        let r = self.recipe(p)?;
        let mut v = vec![0.0f32; r.numel];
        r.eval_whole(&mut v)?;
        round_to(r.dtype, &mut v);
        Ok(v)
    }
}
