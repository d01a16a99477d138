//! Choosing FSDP units: explicit annotation, auto-wrap policies, and the paper's assignment rule.
//!
//! A *unit* is a module whose parameters are flattened, sharded, gathered and freed together.
//! The root module is always a unit. Every parameter belongs to exactly one unit: the deepest
//! unit that encloses **every** use of the parameter. For a parameter used by one module that is
//! the paper's rule ("a unit takes every parameter of its module not already taken by a nested
//! unit"; residual parameters go to the parent). For a parameter shared by several modules (a tied
//! embedding and LM head) it is the unit at or above their lowest common ancestor, so the
//! parameter is unsharded for all of its uses and its gradient is reduced once.
//!
//! This module is pure: it works on a description of the module tree ([`ModuleInfo`]) so it can
//! be tested and reused without tensors.

use std::collections::{BTreeMap, HashMap};

use crate::error::{FsdpError, Result, WrapError};

/// One module of the tree, as seen by the wrapping logic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModuleInfo {
    /// Fully-qualified path ("" for the root, e.g. `blocks.3.attn`).
    pub path: String,
    /// The module's type name (e.g. `Block`), for type-based policies.
    pub type_name: String,
    /// Direct parameters: (local name, parameter identity, number of elements).
    /// The same identity appearing in two modules means a shared (tied) parameter.
    pub params: Vec<(String, usize, usize)>,
}

/// Which modules become FSDP units (besides the root, which always is one).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum WrapPolicy {
    /// Only the root is a unit (one flat parameter for the whole model).
    #[default]
    RootOnly,
    /// Modules whose type name is in the list (PyTorch's `ModuleWrapPolicy`), e.g. `["Block"]`.
    ModuleTypes(Vec<String>),
    /// Modules whose not-yet-wrapped parameters number at least this many elements, decided
    /// bottom-up (PyTorch's `size_based_auto_wrap_policy`).
    MinParams(usize),
    /// Explicit annotation: exactly these module paths.
    Paths(Vec<String>),
    /// The union of several policies.
    Any(Vec<WrapPolicy>),
}

/// The plan for one unit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitPlan {
    /// Path of the unit's module ("" for the root).
    pub path: String,
    /// The unit's parameters, in stable order: (fully-qualified name of the first use, identity,
    /// numel). Shared parameters appear once.
    pub params: Vec<(String, usize, usize)>,
    /// Every fully-qualified name under which each parameter appears (same order as `params`).
    pub aliases: Vec<Vec<String>>,
}

fn components(path: &str) -> Vec<&str> {
    if path.is_empty() {
        Vec::new()
    } else {
        path.split('.').collect()
    }
}

fn is_ancestor_or_self(anc: &str, path: &str) -> bool {
    anc.is_empty() || path == anc || path.starts_with(&format!("{anc}."))
}

fn fqn(module: &str, local: &str) -> String {
    if module.is_empty() {
        local.to_string()
    } else {
        format!("{module}.{local}")
    }
}

fn policy_selects(policy: &WrapPolicy, m: &ModuleInfo, paths: &[String]) -> bool {
    match policy {
        WrapPolicy::RootOnly | WrapPolicy::MinParams(_) => false,
        WrapPolicy::ModuleTypes(types) => types.contains(&m.type_name),
        WrapPolicy::Paths(_) => paths.contains(&m.path),
        WrapPolicy::Any(ps) => ps.iter().any(|p| policy_selects(p, m, paths)),
    }
}

fn explicit_paths(policy: &WrapPolicy, out: &mut Vec<String>) {
    match policy {
        WrapPolicy::Paths(p) => out.extend(p.iter().cloned()),
        WrapPolicy::Any(ps) => ps.iter().for_each(|p| explicit_paths(p, out)),
        _ => {}
    }
}

fn min_params(policy: &WrapPolicy) -> Option<usize> {
    match policy {
        WrapPolicy::MinParams(n) => Some(*n),
        WrapPolicy::Any(ps) => ps.iter().filter_map(min_params).min(),
        _ => None,
    }
}

/// Plans the units for a module tree given in pre-order (the root first, parents before
/// children). Returns the units in pre-order (root first).
///
/// Errors: an empty tree, a root whose path is not "", a tree not in pre-order, or an explicit
/// path that names no module.
pub fn plan_units(modules: &[ModuleInfo], policy: &WrapPolicy) -> Result<Vec<UnitPlan>> {
    let root = modules
        .first()
        .ok_or(FsdpError::Wrap(WrapError::NoModules))?;
    if !root.path.is_empty() {
        return Err(FsdpError::Wrap(WrapError::RootNotFirst {
            path: root.path.clone(),
        }));
    }
    let mut explicit = Vec::new();
    explicit_paths(policy, &mut explicit);
    for p in &explicit {
        if !modules.iter().any(|m| &m.path == p) {
            return Err(FsdpError::Wrap(WrapError::UnknownPath { path: p.clone() }));
        }
    }
    for (i, m) in modules.iter().enumerate().skip(1) {
        let parent = match m.path.rfind('.') {
            Some(k) => &m.path[..k],
            None => "",
        };
        if !modules[..i].iter().any(|p| p.path == parent) {
            return Err(FsdpError::Wrap(WrapError::NotPreOrder {
                module: m.path.clone(),
                parent: parent.to_string(),
            }));
        }
    }

    // 1. Which modules are units.
    let mut is_unit: Vec<bool> = modules
        .iter()
        .map(|m| m.path.is_empty() || policy_selects(policy, m, &explicit))
        .collect();
    if let Some(threshold) = min_params(policy) {
        // Bottom-up: a module becomes a unit if the parameters under it that no nested unit took
        // reach the threshold. Reverse pre-order visits children before parents.
        let mut claimed: HashMap<usize, ()> = HashMap::new();
        for i in (1..modules.len()).rev() {
            if is_unit[i] {
                for j in subtree(modules, i) {
                    for (_, id, _) in &modules[j].params {
                        claimed.insert(*id, ());
                    }
                }
                continue;
            }
            let mut seen = HashMap::new();
            let mut total = 0usize;
            for j in subtree(modules, i) {
                for (_, id, n) in &modules[j].params {
                    if !claimed.contains_key(id) && seen.insert(*id, ()).is_none() {
                        total = total.saturating_add(*n);
                    }
                }
            }
            if total >= threshold && total > 0 {
                is_unit[i] = true;
                for j in subtree(modules, i) {
                    for (_, id, _) in &modules[j].params {
                        claimed.insert(*id, ());
                    }
                }
            }
        }
    }

    // 2. Every use of every parameter, in pre-order.
    let mut uses: BTreeMap<usize, Vec<(String, String, usize)>> = BTreeMap::new(); // id -> (module, fqn, numel)
    let mut first_seen: Vec<usize> = Vec::new();
    for m in modules {
        for (local, id, n) in &m.params {
            let e = uses.entry(*id).or_default();
            if e.is_empty() {
                first_seen.push(*id);
            }
            e.push((m.path.clone(), fqn(&m.path, local), *n));
        }
    }

    // 3. Owner = deepest unit that is an ancestor-or-self of the LCA of all uses.
    let unit_paths: Vec<&str> = modules
        .iter()
        .zip(&is_unit)
        .filter(|(_, u)| **u)
        .map(|(m, _)| m.path.as_str())
        .collect();
    let mut plans: Vec<UnitPlan> = unit_paths
        .iter()
        .map(|p| UnitPlan {
            path: p.to_string(),
            params: Vec::new(),
            aliases: Vec::new(),
        })
        .collect();
    for id in first_seen {
        let u = &uses[&id];
        let mut lca: Vec<&str> = components(&u[0].0);
        for (m, _, _) in &u[1..] {
            let c = components(m);
            let k = lca.iter().zip(&c).take_while(|(a, b)| a == b).count();
            lca.truncate(k);
        }
        let lca = lca.join(".");
        let owner = unit_paths
            .iter()
            .enumerate()
            .filter(|(_, p)| is_ancestor_or_self(p, &lca))
            .max_by_key(|(_, p)| components(p).len())
            .map(|(i, _)| i)
            .expect("the root unit encloses everything");
        plans[owner].params.push((u[0].1.clone(), id, u[0].2));
        plans[owner]
            .aliases
            .push(u.iter().map(|(_, f, _)| f.clone()).collect());
    }
    Ok(plans)
}

/// Indices of module `i` and all its descendants (pre-order makes them contiguous).
fn subtree(modules: &[ModuleInfo], i: usize) -> std::ops::Range<usize> {
    let p = &modules[i].path;
    let mut end = i + 1;
    while end < modules.len() && is_ancestor_or_self(p, &modules[end].path) && !p.is_empty() {
        end += 1;
    }
    if p.is_empty() {
        end = modules.len();
    }
    i..end
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(path: &str, ty: &str, params: &[(&str, usize, usize)]) -> ModuleInfo {
        ModuleInfo {
            path: path.into(),
            type_name: ty.into(),
            params: params
                .iter()
                .map(|(n, id, k)| (n.to_string(), *id, *k))
                .collect(),
        }
    }

    /// root(emb, blocks.0(lin1, lin2), blocks.1(lin1, lin2), head)
    fn gpt_like(tied: bool) -> Vec<ModuleInfo> {
        vec![
            m("", "Gpt", &[]),
            m("emb", "Embedding", &[("weight", 1, 100)]),
            m("blocks", "List", &[]),
            m("blocks.0", "Block", &[]),
            m(
                "blocks.0.fc",
                "Linear",
                &[("weight", 2, 40), ("bias", 3, 4)],
            ),
            m("blocks.1", "Block", &[]),
            m(
                "blocks.1.fc",
                "Linear",
                &[("weight", 4, 40), ("bias", 5, 4)],
            ),
            m(
                "head",
                "Linear",
                &[("weight", if tied { 1 } else { 6 }, 100)],
            ),
        ]
    }

    fn names(p: &UnitPlan) -> Vec<&str> {
        p.params.iter().map(|(n, _, _)| n.as_str()).collect()
    }

    #[test]
    fn root_only_takes_everything() {
        let u = plan_units(&gpt_like(false), &WrapPolicy::RootOnly).unwrap();
        assert_eq!(u.len(), 1);
        assert_eq!(u[0].params.len(), 6);
    }

    #[test]
    fn type_policy_nested_units_take_theirs_root_takes_residual() {
        let u = plan_units(
            &gpt_like(false),
            &WrapPolicy::ModuleTypes(vec!["Block".into()]),
        )
        .unwrap();
        let paths: Vec<_> = u.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(paths, ["", "blocks.0", "blocks.1"]);
        assert_eq!(names(&u[0]), ["emb.weight", "head.weight"]);
        assert_eq!(names(&u[1]), ["blocks.0.fc.weight", "blocks.0.fc.bias"]);
        assert_eq!(names(&u[2]), ["blocks.1.fc.weight", "blocks.1.fc.bias"]);
    }

    #[test]
    fn tied_parameter_goes_to_lowest_common_ancestor_unit() {
        // emb and head are both units; their shared weight must live in the root (their LCA).
        let pol = WrapPolicy::Paths(vec!["emb".into(), "head".into()]);
        let u = plan_units(&gpt_like(true), &pol).unwrap();
        let root = &u[0];
        assert_eq!(
            names(root),
            [
                "emb.weight",
                "blocks.0.fc.weight",
                "blocks.0.fc.bias",
                "blocks.1.fc.weight",
                "blocks.1.fc.bias"
            ]
        );
        assert_eq!(root.aliases[0], ["emb.weight", "head.weight"]);
        assert!(u[1].params.is_empty() && u[2].params.is_empty());
    }

    #[test]
    fn size_policy_is_bottom_up() {
        // threshold 44: each blocks.i.fc (44 elements) becomes a unit, not blocks.i (nothing left).
        let u = plan_units(&gpt_like(false), &WrapPolicy::MinParams(44)).unwrap();
        let paths: Vec<_> = u.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(paths, ["", "emb", "blocks.0.fc", "blocks.1.fc", "head"]);
        let total: usize = u.iter().flat_map(|p| p.params.iter().map(|x| x.2)).sum();
        assert_eq!(total, 288);
    }

    #[test]
    fn unknown_explicit_path_is_an_error() {
        let e = plan_units(
            &gpt_like(false),
            &WrapPolicy::Paths(vec!["blocks.7".into()]),
        )
        .unwrap_err();
        assert!(e.to_string().contains("blocks.7"), "{e}");
    }

    #[test]
    fn every_parameter_in_exactly_one_unit() {
        for pol in [
            WrapPolicy::RootOnly,
            WrapPolicy::ModuleTypes(vec!["Block".into(), "Linear".into()]),
            WrapPolicy::MinParams(1),
            WrapPolicy::Any(vec![
                WrapPolicy::Paths(vec!["blocks".into()]),
                WrapPolicy::MinParams(100),
            ]),
        ] {
            for tied in [false, true] {
                let u = plan_units(&gpt_like(tied), &pol).unwrap();
                let mut ids: Vec<usize> = u
                    .iter()
                    .flat_map(|p| p.params.iter().map(|x| x.1))
                    .collect();
                ids.sort();
                let n = ids.len();
                ids.dedup();
                assert_eq!(ids.len(), n, "{pol:?}");
                assert_eq!(n, if tied { 5 } else { 6 }, "{pol:?}");
            }
        }
    }
}
