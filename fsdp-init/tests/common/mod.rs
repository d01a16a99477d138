//! Shared helpers of the fsdp-init integration tests.
#![allow(dead_code)]

use fsdp_alloc::{DType, Device};
use fsdp_autograd::init::{FanMode, InitOp, Nonlinearity};
use fsdp_autograd::nn::{named_parameters, Module};
use fsdp_autograd::{InitContext, Parameter, Tensor};
use fsdp_flatparam::FlatParamLayout;
use half::{bf16, f16};

/// The raw bits of every element of a float tensor (f32 bits, or f16/bf16 bits widened).
pub fn bits(t: &Tensor) -> Vec<u32> {
    match t.dtype() {
        DType::F32 => t
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect(),
        DType::F16 => t
            .to_vec::<f16>()
            .unwrap()
            .iter()
            .map(|x| u32::from(x.to_bits()))
            .collect(),
        DType::BF16 => t
            .to_vec::<bf16>()
            .unwrap()
            .iter()
            .map(|x| u32::from(x.to_bits()))
            .collect(),
        d => panic!("not a float dtype: {d}"),
    }
}

/// The eager unit's flat parameter (bits), padded with zeros as the layout says.
pub fn eager_flat_bits(unit: &[Parameter], layout: &FlatParamLayout) -> Vec<u32> {
    let vals: Vec<Vec<u32>> = unit.iter().map(|p| bits(&p.get().unwrap())).collect();
    layout.flatten(&vals).unwrap()
}

/// The layout of a unit over `world` ranks.
pub fn layout_of(unit: &[Parameter], world: usize) -> FlatParamLayout {
    let shapes: Vec<Vec<usize>> = unit.iter().map(|p| p.shape().to_vec()).collect();
    FlatParamLayout::new(&shapes, world).unwrap()
}

/// A module holding a flat list of parameters (for `materialize(model)`).
pub struct ParamList {
    pub params: Vec<(String, Parameter)>,
    hooks: fsdp_autograd::nn::ModuleHooks,
}

impl ParamList {
    pub fn new(params: Vec<Parameter>) -> ParamList {
        ParamList {
            params: params
                .into_iter()
                .enumerate()
                .map(|(i, p)| (format!("p{i}"), p))
                .collect(),
            hooks: fsdp_autograd::nn::ModuleHooks::new(),
        }
    }
}

impl Module for ParamList {
    fn forward(&self, x: &Tensor) -> fsdp_autograd::Result<Tensor> {
        Ok(x.clone())
    }
    fn visit_params(&self, f: &mut dyn FnMut(&str, &Parameter)) {
        for (n, p) in &self.params {
            f(n, p);
        }
    }
    fn visit_children<'a>(&'a self, _f: &mut dyn FnMut(&str, &'a dyn Module)) {}
    fn type_name(&self) -> &'static str {
        "ParamList"
    }
    fn hooks(&self) -> &fsdp_autograd::nn::ModuleHooks {
        &self.hooks
    }
}

/// A deterministic whole-tensor init: rows normalized to unit L2 norm (an "orthogonal-like"
/// closure that needs every element of a row).
pub fn normalize_rows() -> InitOp {
    InitOp::custom("normalize_rows", |v: &mut [f32], shape: &[usize]| {
        let cols = shape.last().copied().unwrap_or(1).max(1);
        for row in v.chunks_mut(cols) {
            let n = row.iter().map(|x| x * x).sum::<f32>().sqrt();
            if n > 0.0 {
                row.iter_mut().for_each(|x| *x /= n);
            }
        }
    })
}

/// Every kind of op, as (name, shape, ops) in creation order of one dtype's unit. `CopyFrom`
/// sources come earlier in the list, as an eager context requires.
pub fn every_op_specs(prefix: &str) -> Vec<(String, Vec<usize>, Vec<InitOp>)> {
    let n = |s: &str| format!("{prefix}.{s}");
    vec![
        (n("zeros"), vec![7], vec![InitOp::Fill(0.0)]),
        (n("ones"), vec![3, 5], vec![InitOp::Fill(1.0)]),
        (n("fill"), vec![5], vec![InitOp::Fill(-0.75)]),
        (
            n("uniform"),
            vec![17, 9],
            vec![InitOp::Uniform {
                low: -0.5,
                high: 2.0,
            }],
        ),
        (
            n("normal"),
            vec![33, 7],
            vec![InitOp::Normal {
                mean: 0.1,
                std: 0.02,
            }],
        ),
        (
            n("trunc"),
            vec![19, 4],
            vec![InitOp::TruncatedNormal {
                mean: 0.0,
                std: 1.0,
                a: -2.0,
                b: 2.0,
            }],
        ),
        (
            n("kaiming_u"),
            vec![24, 6, 3],
            vec![InitOp::KaimingUniform {
                mode: FanMode::FanIn,
                nonlinearity: Nonlinearity::LeakyRelu(5f32.sqrt()),
            }],
        ),
        (
            n("kaiming_n"),
            vec![11, 13],
            vec![InitOp::KaimingNormal {
                mode: FanMode::FanOut,
                nonlinearity: Nonlinearity::Relu,
            }],
        ),
        (
            n("xavier_u"),
            vec![10, 20],
            vec![InitOp::XavierUniform { gain: 1.0 }],
        ),
        (
            n("xavier_n"),
            vec![20, 10],
            vec![InitOp::XavierNormal { gain: 5.0 / 3.0 }],
        ),
        (
            n("scaled"),
            vec![16, 8],
            vec![
                InitOp::Normal {
                    mean: 0.0,
                    std: 0.02,
                },
                InitOp::Scale(0.125),
            ],
        ),
        (
            n("empty"),
            vec![0, 4],
            vec![InitOp::Normal {
                mean: 0.0,
                std: 1.0,
            }],
        ),
        (
            n("scalar"),
            vec![],
            vec![InitOp::Fill(3.0), InitOp::Scale(0.5)],
        ),
        // A copy of a position-wise parameter, scaled: position-wise itself.
        (
            n("copy"),
            vec![33, 7],
            vec![
                InitOp::CopyFrom {
                    source: n("normal"),
                },
                InitOp::Scale(0.3),
            ],
        ),
        // A whole-tensor closure.
        (
            n("custom"),
            vec![12, 10],
            vec![
                InitOp::Uniform {
                    low: -1.0,
                    high: 1.0,
                },
                normalize_rows(),
            ],
        ),
        // Orthogonal (whole-tensor, built-in): tall, and wide with a third dimension.
        (
            n("orthogonal"),
            vec![12, 5],
            vec![InitOp::Orthogonal { gain: 1.0 }],
        ),
        (
            n("orthogonal_wide"),
            vec![4, 3, 3],
            vec![InitOp::Orthogonal { gain: 2.0 }, InitOp::Scale(0.5)],
        ),
        // A copy of the closure's result: whole-tensor through its source.
        (
            n("copy_custom"),
            vec![10, 12],
            vec![
                InitOp::CopyFrom {
                    source: n("custom"),
                },
                InitOp::Scale(-1.0),
            ],
        ),
        // Ops before the last overwrite do not matter.
        (
            n("overwritten"),
            vec![9],
            vec![
                normalize_rows(),
                InitOp::CopyFrom { source: n("zeros") },
                InitOp::Normal {
                    mean: 1.0,
                    std: 2.0,
                },
            ],
        ),
    ]
}

/// Builds the specs in `ctx` with `dtype`.
pub fn build(
    ctx: &InitContext,
    specs: &[(String, Vec<usize>, Vec<InitOp>)],
    dtype: DType,
) -> Vec<Parameter> {
    specs
        .iter()
        .map(|(name, shape, ops)| ctx.param(name, shape, dtype, ops.clone()).unwrap())
        .collect()
}

/// The GPT's units: one per block, and the root unit with everything else.
pub fn gpt_units(model: &dyn Module) -> Vec<Vec<Parameter>> {
    let named = named_parameters(model);
    let mut blocks: Vec<Vec<Parameter>> = Vec::new();
    let mut root = Vec::new();
    for (name, p) in named {
        if let Some(rest) = name.strip_prefix("blocks.") {
            let i: usize = rest.split('.').next().unwrap().parse().unwrap();
            if blocks.len() <= i {
                blocks.resize_with(i + 1, Vec::new);
            }
            blocks[i].push(p);
        } else {
            root.push(p);
        }
    }
    let mut units = vec![root];
    units.extend(blocks);
    units
}

/// A CPU device with a capacity and no caching (reserved = allocated, exact accounting).
pub fn capped_device(index: usize, bytes: usize) -> Device {
    Device::cpu_with(
        index,
        fsdp_alloc::DeviceConfig {
            capacity: fsdp_alloc::Capacity::Bytes(bytes),
            caching: false,
            ..Default::default()
        },
    )
}

/// Allocator rounding (512 B).
pub fn round512(n: usize) -> usize {
    n.div_ceil(512) * 512
}
