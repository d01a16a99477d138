//! What FSDP says about a wrapped model's units and groups: the public descriptions
//! ([`UnitInfo`], [`ParamBytes`], [`UnitShard`], [`FullParameter`]), the process groups it runs
//! over ([`Comm`]), and the module-tree walks `Fsdp::wrap` plans units from.

use std::sync::Arc;

use fsdp_alloc::DType;
use fsdp_autograd::nn::Module;
use fsdp_autograd::{Parameter, Tensor};
use fsdp_collectives::{DeviceMesh, ProcessGroup};
use fsdp_flatparam::FlatParamLayout;

use crate::wrap::ModuleInfo;

/// The process groups FSDP communicates over.
#[derive(Debug, Clone)]
pub enum Comm {
    /// One group of all ranks (FullShard, ShardGradOp, NoShard).
    Group(Arc<dyn ProcessGroup>),
    /// A 2-D mesh of shard and replicate groups (HybridShard; the other strategies use its world).
    Mesh(DeviceMesh),
}

impl From<Arc<dyn ProcessGroup>> for Comm {
    fn from(g: Arc<dyn ProcessGroup>) -> Comm {
        Comm::Group(g)
    }
}

impl From<DeviceMesh> for Comm {
    fn from(m: DeviceMesh) -> Comm {
        Comm::Mesh(m)
    }
}

/// One gathered parameter: (fully-qualified name, shape, values).
pub type FullParameter = (String, Vec<usize>, Vec<f32>);

/// One unit as [`Fsdp::units`](crate::Fsdp::units) describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitInfo {
    /// Module path of the unit ("" for the root).
    pub path: String,
    /// Fully-qualified name of each parameter of the unit, in layout order.
    pub names: Vec<String>,
    /// Elements of all the unit's parameters (no padding).
    pub total_numel: usize,
    /// Elements of this rank's shard (the padded flat parameter divided by the sharding
    /// factor; the whole padded flat parameter for `NoShard`).
    pub shard_numel: usize,
}

/// Sizes of the wrapped model's parameters in f32 bytes (the precision FSDP stores them in),
/// padding of the flat parameters included, whatever the mixed-precision setting: the paper's
/// Ψ and ψ_max (§3.2.1), times 4.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamBytes {
    /// Bytes of the largest unit's flat parameter (4·ψ_max).
    pub max_unit: usize,
    /// Bytes of all units' flat parameters (4·Ψ).
    pub total: usize,
}

impl ParamBytes {
    /// The number of parameter elements in all units (Ψ, padding included).
    pub fn total_numel(&self) -> usize {
        self.total / DType::F32.size()
    }

    /// The number of parameter elements in the largest unit (ψ_max, padding included).
    pub fn max_unit_numel(&self) -> usize {
        self.max_unit / DType::F32.size()
    }
}

/// One unit's sharded state on this rank, for optimizers, gradient clipping, scalers and state
/// dicts. The tensors are handles to FSDP's own shards: in-place updates (launched on the compute
/// stream, e.g. inside `with_stream(fsdp.compute_stream(), ..)`) change the parameters; call
/// [`Fsdp::params_updated`](crate::Fsdp::params_updated) afterwards so the next all-gather waits for them.
#[derive(Debug, Clone)]
pub struct UnitShard {
    /// Module path of the unit ("" for the root).
    pub path: String,
    /// Fully-qualified name of each parameter of the unit, in layout order.
    pub names: Vec<String>,
    /// The unit's flat-parameter layout (sharding factor = shard-group size; 1 for `NoShard`).
    pub layout: FlatParamLayout,
    /// Which chunk of the layout this rank holds.
    pub rank: usize,
    /// This rank's shard: f32, `layout.chunk_numel()` elements (padding at the tail is zero).
    pub shard: Tensor,
    /// The reduced (summed over ranks) gradient of the shard, if a backward produced one.
    pub grad: Option<Tensor>,
    /// Whether each parameter is trainable (frozen parameters' gradient pieces are zero).
    pub requires_grad: Vec<bool>,
}

/// Walks the module tree in pre-order, collecting what wrapping needs.
pub(crate) fn describe(model: &dyn Module) -> (Vec<ModuleInfo>, Vec<Parameter>) {
    fn walk(
        m: &dyn Module,
        path: String,
        infos: &mut Vec<ModuleInfo>,
        params: &mut Vec<Parameter>,
    ) {
        let mut direct = Vec::new();
        m.visit_params(&mut |name, p| {
            let id = match params.iter().position(|q| q.ptr_eq(p)) {
                Some(i) => i,
                None => {
                    params.push(p.clone());
                    params.len() - 1
                }
            };
            direct.push((name.to_string(), id, p.numel()));
        });
        infos.push(ModuleInfo {
            path: path.clone(),
            type_name: m.type_name().to_string(),
            params: direct,
        });
        m.visit_children(&mut |name, c| {
            let p = if path.is_empty() {
                name.to_string()
            } else {
                format!("{path}.{name}")
            };
            walk(c, p, infos, params);
        });
    }
    let mut infos = Vec::new();
    let mut params = Vec::new();
    walk(model, String::new(), &mut infos, &mut params);
    (infos, params)
}

/// Visits every module with its path (pre-order).
pub(crate) fn for_each_module<'a>(
    m: &'a dyn Module,
    path: &str,
    f: &mut dyn FnMut(&str, &'a dyn Module),
) {
    f(path, m);
    m.visit_children(&mut |name, c| {
        let p = if path.is_empty() {
            name.to_string()
        } else {
            format!("{path}.{name}")
        };
        for_each_module(c, &p, f);
    });
}
