//! A plain (local, unsharded) SGD optimizer with optional momentum and weight decay, for
//! single-device training and tests. fsdp-core has the sharded optimizers.

use crate::context::no_grad;
use crate::error::Result;
use crate::param::Parameter;
use crate::tensor::Tensor;

/// Stochastic gradient descent: `v = μ·v + (g + λ·p)`, `p -= lr·v` (PyTorch's formulation;
/// with `μ = 0` simply `p -= lr·(g + λ·p)`). Updates run as kernels on the current stream.
///
/// ```
/// use fsdp_alloc::{DType, Device};
/// use fsdp_autograd::{init::InitOp, optim::Sgd, InitContext};
///
/// let dev = Device::cpu(0);
/// let p = InitContext::eager(&dev, 0).param("w", &[2], DType::F32, vec![InitOp::Fill(1.0)])?;
/// p.get()?.sum()?.backward()?; // grad = 1
/// let mut opt = Sgd::new(vec![p.clone()], 0.5);
/// opt.step()?;
/// assert_eq!(p.get()?.to_vec::<f32>()?, vec![0.5, 0.5]);
/// # Ok::<(), fsdp_autograd::AutogradError>(())
/// ```
#[derive(Debug)]
pub struct Sgd {
    params: Vec<Parameter>,
    /// Learning rate.
    pub lr: f32,
    /// Momentum factor μ (0 disables momentum).
    pub momentum: f32,
    /// Weight decay λ (L2, added to the gradient).
    pub weight_decay: f32,
    velocity: Vec<Option<Tensor>>,
}

impl Sgd {
    /// SGD over `params` with learning rate `lr`, no momentum or weight decay.
    pub fn new(params: Vec<Parameter>, lr: f32) -> Sgd {
        let n = params.len();
        Sgd {
            params,
            lr,
            momentum: 0.0,
            weight_decay: 0.0,
            velocity: vec![None; n],
        }
    }

    /// With momentum μ.
    pub fn with_momentum(mut self, momentum: f32) -> Sgd {
        self.momentum = momentum;
        self
    }

    /// With weight decay λ.
    pub fn with_weight_decay(mut self, weight_decay: f32) -> Sgd {
        self.weight_decay = weight_decay;
        self
    }

    /// The parameters.
    pub fn params(&self) -> &[Parameter] {
        &self.params
    }

    /// One update of every parameter that has a gradient.
    ///
    /// # Errors
    /// Errors of the update kernels (released storage, dtype mismatch).
    pub fn step(&mut self) -> Result<()> {
        no_grad(|| {
            for (p, v) in self.params.iter().zip(self.velocity.iter_mut()) {
                let Some(t) = p.try_get() else { continue };
                let Some(g) = t.grad() else { continue };
                let mut d = g;
                if self.weight_decay != 0.0 {
                    let dd = d.contiguous_copy()?;
                    dd.add_scaled_(&t, self.weight_decay)?;
                    d = dd;
                }
                if self.momentum != 0.0 {
                    match v {
                        Some(buf) => {
                            buf.scale_(self.momentum)?;
                            buf.add_(&d)?;
                        }
                        None => *v = Some(d.contiguous_copy()?),
                    }
                    d = v.clone().expect("velocity set above");
                }
                t.add_scaled_(&d, -self.lr)?;
            }
            Ok(())
        })
    }

    /// Clears the gradients of all parameters.
    pub fn zero_grad(&self) {
        for p in &self.params {
            if let Some(t) = p.try_get() {
                t.zero_grad();
            }
        }
    }
}
