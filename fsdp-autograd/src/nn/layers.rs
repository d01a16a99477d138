//! Basic layers: Linear, Embedding, LayerNorm, RmsNorm and a Sequential container.

use fsdp_alloc::DType;

use crate::error::{AutogradError, Result};
use crate::init::{FanMode, InitOp, Nonlinearity};
use crate::nn::{Module, ModuleHooks};
use crate::ops;
use crate::param::{InitContext, Parameter};
use crate::tensor::Tensor;

/// `y = x·Wᵀ + b` with `weight` `[out, in]` and optional `bias` `[out]`.
#[derive(Debug)]
pub struct Linear {
    /// `[out_features, in_features]`.
    pub weight: Parameter,
    /// `[out_features]`, if any.
    pub bias: Option<Parameter>,
    hooks: ModuleHooks,
}

impl Linear {
    /// PyTorch's default init: weight Kaiming-uniform (`a = √5`, i.e. uniform ±1/√in), bias
    /// uniform ±1/√in. `f32`.
    pub fn new(
        ctx: &InitContext,
        in_features: usize,
        out_features: usize,
        bias: bool,
    ) -> Result<Linear> {
        let bound = if in_features > 0 {
            1.0 / (in_features as f32).sqrt()
        } else {
            0.0
        };
        Linear::with_init(
            ctx,
            in_features,
            out_features,
            bias,
            DType::F32,
            vec![InitOp::KaimingUniform {
                mode: FanMode::FanIn,
                nonlinearity: Nonlinearity::LeakyRelu(5f32.sqrt()),
            }],
            vec![InitOp::Uniform {
                low: -bound,
                high: bound,
            }],
        )
    }

    /// A linear layer with the given init ops for weight and bias.
    #[allow(clippy::too_many_arguments)]
    pub fn with_init(
        ctx: &InitContext,
        in_features: usize,
        out_features: usize,
        bias: bool,
        dtype: DType,
        weight_init: Vec<InitOp>,
        bias_init: Vec<InitOp>,
    ) -> Result<Linear> {
        let weight = ctx.param("weight", &[out_features, in_features], dtype, weight_init)?;
        let bias = if bias {
            Some(ctx.param("bias", &[out_features], dtype, bias_init)?)
        } else {
            None
        };
        Ok(Linear {
            weight,
            bias,
            hooks: ModuleHooks::new(),
        })
    }

    /// A linear layer over existing parameters (e.g. a head tied to an embedding table, which
    /// is `[vocab, d]`: exactly a `[out, in]` weight).
    ///
    /// # Errors
    /// [`AutogradError::Parameter`] if the weight is not 2-D or the bias does not match.
    pub fn from_params(weight: Parameter, bias: Option<Parameter>) -> Result<Linear> {
        if weight.shape().len() != 2 {
            return Err(AutogradError::Parameter {
                name: weight.name().to_string(),
                detail: format!("a Linear weight must be 2-D, got {:?}", weight.shape()),
            });
        }
        if let Some(b) = &bias {
            if b.shape() != [weight.shape()[0]] {
                return Err(AutogradError::Parameter {
                    name: b.name().to_string(),
                    detail: format!(
                        "bias {:?} does not match weight {:?}",
                        b.shape(),
                        weight.shape()
                    ),
                });
            }
        }
        Ok(Linear {
            weight,
            bias,
            hooks: ModuleHooks::new(),
        })
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let b = self.bias.as_ref().map(Parameter::get).transpose()?;
        ops::linear(x, &self.weight.get()?, b.as_ref())
    }
    fn visit_params(&self, f: &mut dyn FnMut(&str, &Parameter)) {
        f("weight", &self.weight);
        if let Some(b) = &self.bias {
            f("bias", b);
        }
    }
    fn visit_children<'a>(&'a self, _f: &mut dyn FnMut(&str, &'a dyn Module)) {}
    fn type_name(&self) -> &'static str {
        "Linear"
    }
    fn hooks(&self) -> &ModuleHooks {
        &self.hooks
    }
}

/// A lookup table `[num, dim]`; forward takes `i64` ids and returns `[ids.., dim]`.
#[derive(Debug)]
pub struct Embedding {
    /// `[num_embeddings, dim]`.
    pub weight: Parameter,
    hooks: ModuleHooks,
}

impl Embedding {
    /// PyTorch's default init: Normal(0, 1). `f32`.
    pub fn new(ctx: &InitContext, num: usize, dim: usize) -> Result<Embedding> {
        Embedding::with_init(
            ctx,
            num,
            dim,
            DType::F32,
            vec![InitOp::Normal {
                mean: 0.0,
                std: 1.0,
            }],
        )
    }

    /// An embedding with the given init ops.
    pub fn with_init(
        ctx: &InitContext,
        num: usize,
        dim: usize,
        dtype: DType,
        init: Vec<InitOp>,
    ) -> Result<Embedding> {
        Ok(Embedding {
            weight: ctx.param("weight", &[num, dim], dtype, init)?,
            hooks: ModuleHooks::new(),
        })
    }
}

impl Module for Embedding {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        ops::embedding(ids, &self.weight.get()?)
    }
    fn visit_params(&self, f: &mut dyn FnMut(&str, &Parameter)) {
        f("weight", &self.weight);
    }
    fn visit_children<'a>(&'a self, _f: &mut dyn FnMut(&str, &'a dyn Module)) {}
    fn type_name(&self) -> &'static str {
        "Embedding"
    }
    fn hooks(&self) -> &ModuleHooks {
        &self.hooks
    }
}

/// Layer normalization over the last dimension with affine `weight` (ones) and `bias` (zeros).
#[derive(Debug)]
pub struct LayerNorm {
    /// `[dim]`, initialized to ones.
    pub weight: Parameter,
    /// `[dim]`, initialized to zeros.
    pub bias: Parameter,
    /// Added to the variance.
    pub eps: f32,
    hooks: ModuleHooks,
}

impl LayerNorm {
    /// `eps = 1e-5`, `f32`.
    pub fn new(ctx: &InitContext, dim: usize) -> Result<LayerNorm> {
        Ok(LayerNorm {
            weight: ctx.param("weight", &[dim], DType::F32, vec![InitOp::Fill(1.0)])?,
            bias: ctx.param("bias", &[dim], DType::F32, vec![InitOp::Fill(0.0)])?,
            eps: 1e-5,
            hooks: ModuleHooks::new(),
        })
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        ops::layer_norm(x, &self.weight.get()?, &self.bias.get()?, self.eps)
    }
    fn visit_params(&self, f: &mut dyn FnMut(&str, &Parameter)) {
        f("weight", &self.weight);
        f("bias", &self.bias);
    }
    fn visit_children<'a>(&'a self, _f: &mut dyn FnMut(&str, &'a dyn Module)) {}
    fn type_name(&self) -> &'static str {
        "LayerNorm"
    }
    fn hooks(&self) -> &ModuleHooks {
        &self.hooks
    }
}

/// RMS normalization over the last dimension (Llama's `RMSNorm`):
/// `x / √(mean(x²) + eps) · weight` ([`ops::rms_norm`]).
#[derive(Debug)]
pub struct RmsNorm {
    /// `[dim]`, initialized to ones.
    pub weight: Parameter,
    /// Added to the mean square.
    pub eps: f32,
    hooks: ModuleHooks,
}

impl RmsNorm {
    /// `f32` weight of ones and `eps` (Llama uses `1e-5` or `1e-6`; transformers' default is
    /// `1e-6`).
    pub fn new(ctx: &InitContext, dim: usize, eps: f32) -> Result<RmsNorm> {
        Ok(RmsNorm {
            weight: ctx.param("weight", &[dim], DType::F32, vec![InitOp::Fill(1.0)])?,
            eps,
            hooks: ModuleHooks::new(),
        })
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        ops::rms_norm(x, &self.weight.get()?, self.eps)
    }
    fn visit_params(&self, f: &mut dyn FnMut(&str, &Parameter)) {
        f("weight", &self.weight);
    }
    fn visit_children<'a>(&'a self, _f: &mut dyn FnMut(&str, &'a dyn Module)) {}
    fn type_name(&self) -> &'static str {
        "RmsNorm"
    }
    fn hooks(&self) -> &ModuleHooks {
        &self.hooks
    }
}

/// Children named `0`, `1`, … called in order.
pub struct Sequential {
    items: Vec<Box<dyn Module>>,
    hooks: ModuleHooks,
}

impl std::fmt::Debug for Sequential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.items.iter().map(|m| m.type_name()).collect();
        f.debug_struct("Sequential").field("items", &names).finish()
    }
}

impl Sequential {
    /// A container of `items`.
    pub fn new(items: Vec<Box<dyn Module>>) -> Sequential {
        Sequential {
            items,
            hooks: ModuleHooks::new(),
        }
    }

    /// The items.
    pub fn items(&self) -> &[Box<dyn Module>] {
        &self.items
    }

    /// Number of items.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// True if there are no items.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

impl Module for Sequential {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut x = x.clone();
        for m in &self.items {
            x = m.call(&x)?;
        }
        Ok(x)
    }
    fn visit_params(&self, _f: &mut dyn FnMut(&str, &Parameter)) {}
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(&str, &'a dyn Module)) {
        for (i, m) in self.items.iter().enumerate() {
            f(&i.to_string(), m.as_ref());
        }
    }
    fn type_name(&self) -> &'static str {
        "Sequential"
    }
    fn hooks(&self) -> &ModuleHooks {
        &self.hooks
    }
}

#[cfg(test)]
mod tests {
    use fsdp_alloc::Device;

    use super::*;

    /// The module is the op with its weight: forward equals `x.rms_norm(weight)`, the gradient
    /// reaches the weight, and the weight is its one parameter.
    #[test]
    fn rms_norm_module_is_the_op_with_its_weight() {
        let dev = Device::cpu(0);
        let m = RmsNorm::new(&InitContext::eager(&dev, 0), 4, 1e-6).unwrap();
        let x = Tensor::from_vec(
            vec![1.0f32, -2.0, 3.0, 0.5, 2.0, 2.0, -1.0, 4.0],
            &[2, 4],
            &dev,
        )
        .unwrap();
        let w = m.weight.get().unwrap();
        assert_eq!(w.to_vec::<f32>().unwrap(), vec![1.0; 4]);
        let y = m.forward(&x).unwrap();
        let want = x.rms_norm(&w, 1e-6).unwrap();
        assert_eq!(y.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
        y.sum().unwrap().backward().unwrap();
        let g = m.weight.get().unwrap().grad().expect("weight gradient");
        assert_eq!(g.shape(), [4]);
        let mut names = Vec::new();
        m.visit_params(&mut |n, _| names.push(n.to_string()));
        assert_eq!(names, ["weight"]);
        assert_eq!(m.type_name(), "RmsNorm");
    }
}
