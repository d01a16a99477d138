//! AdamW (PyTorch's single-tensor algorithm, decoupled weight decay): the hyper-parameters
//! shared with LAMB, the rule, and the sharded and local optimizers running it.

use fsdp_autograd::kernels::optim::{adamw_step, AdamWStep};
use fsdp_autograd::Parameter;

use super::driver::{Local, Sharded};
use super::rule::{
    check_betas, check_finite, kernel_err, missing_slices, slots, ElementwiseRule, Rule, StepArgs,
};
use crate::error::Result;

/// AdamW hyper-parameters, shared by [`AdamW`], [`LocalAdamW`], [`super::Lamb`] and
/// [`super::LocalLamb`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamParams {
    /// Learning rate.
    pub lr: f32,
    /// Decay rates (β1, β2) of the first and second moments.
    pub betas: (f32, f32),
    /// Added to the denominator for stability.
    pub eps: f32,
    /// Decoupled weight decay λ (AdamW: `p ← p·(1 − lr·λ)`; LAMB: `+ λ·p` in the direction).
    pub weight_decay: f32,
}

impl AdamParams {
    /// PyTorch's defaults with learning rate `lr`: betas (0.9, 0.999), eps 1e-8, weight decay
    /// 0.01.
    pub fn new(lr: f32) -> AdamParams {
        AdamParams {
            lr,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }

    /// Checks every hyper-parameter.
    pub(crate) fn check(&self, op: &str) -> Result<()> {
        check_finite(op, "lr", self.lr)?;
        check_finite(op, "weight_decay", self.weight_decay)?;
        check_betas(op, self.betas, self.eps)
    }
}

/// AdamW's scalars for one step `t`, as the kernels see them (computed in f64, rounded to f32
/// once): the seam's type, made by [`Rule::coeffs`].
pub use fsdp_autograd::kernels::optim::AdamCoeffs;

/// AdamW's update rule (slots `exp_avg`, `exp_avg_sq`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWRule {
    /// Hyper-parameters (`lr`, `betas`, `eps`, `weight_decay`).
    pub hyper: AdamParams,
}

impl Rule for AdamWRule {
    const NAME: &'static str = "AdamW";
    const TITLE: &'static str = "AdamW";
    const KERNEL: &'static str = "adamw";
    const SLOTS: &'static [&'static str] = &["exp_avg", "exp_avg_sq"];
    type Coeffs = AdamCoeffs;

    fn check(&self, op: &str) -> Result<()> {
        self.hyper.check(op)
    }

    fn coeffs(&self, step: u64) -> AdamCoeffs {
        let h = self.hyper;
        AdamCoeffs::new(h.lr, h.betas, h.eps, h.weight_decay, step)
    }

    fn lr(&self) -> f32 {
        self.hyper.lr
    }

    fn set_lr(&mut self, lr: f32) {
        self.hyper.lr = lr;
    }

    fn update(
        c: &AdamCoeffs,
        p: &mut [f32],
        g: &[f32],
        state: &mut [&mut [f32]],
        _: bool,
    ) -> Result<()> {
        let n = state.len();
        let [m, v] = state else {
            return Err(missing_slices("AdamW", n, 2));
        };
        adamw_step(c, p, g, m, v).map_err(kernel_err)
    }

    fn launch(c: &AdamCoeffs, a: &StepArgs<'_>) -> Result<()> {
        let [m, v] = slots::<2>("AdamW::step", a)?;
        let l = AdamWStep {
            n: a.p.numel(),
            c: *c,
            p: a.p,
            g: a.g,
            m,
            v,
        };
        Ok(a.kernels.launch(a.stream, &l)?)
    }
}

impl ElementwiseRule for AdamWRule {}

/// Sharded AdamW (PyTorch's algorithm, decoupled weight decay) with `exp_avg` and `exp_avg_sq`
/// of `chunk_numel` elements per unit; `opt.hyper` holds the hyper-parameters. Example in the
/// [module docs](super).
pub type AdamW = Sharded<AdamWRule>;

impl Sharded<AdamWRule> {
    /// AdamW with learning rate `lr` and PyTorch's defaults (see [`AdamParams::new`]).
    pub fn new(lr: f32) -> AdamW {
        AdamW::with_params(AdamParams::new(lr))
    }

    /// AdamW with the given hyper-parameters.
    pub fn with_params(hyper: AdamParams) -> AdamW {
        Sharded::from_rule(AdamWRule { hyper })
    }

    /// With betas (β1, β2).
    pub fn with_betas(mut self, betas: (f32, f32)) -> AdamW {
        self.hyper.betas = betas;
        self
    }

    /// With eps.
    pub fn with_eps(mut self, eps: f32) -> AdamW {
        self.hyper.eps = eps;
        self
    }

    /// With weight decay λ.
    pub fn with_weight_decay(mut self, weight_decay: f32) -> AdamW {
        self.hyper.weight_decay = weight_decay;
        self
    }
}

/// Local AdamW over plain parameters with exactly [`AdamW`]'s arithmetic.
///
/// ```
/// use fsdp_alloc::{DType, Device};
/// use fsdp_autograd::{init::InitOp, InitContext};
/// use fsdp_core::optim::{AdamParams, LocalAdamW, LocalOptimizer};
///
/// let dev = Device::cpu(0);
/// let p = InitContext::eager(&dev, 0).param("w", &[3], DType::F32, vec![InitOp::Fill(1.0)])?;
/// let hp = AdamParams { weight_decay: 0.0, ..AdamParams::new(0.1) };
/// let mut opt = LocalAdamW::new(vec![p.clone()], hp);
/// p.get()?.sum()?.backward()?;
/// opt.step()?;
/// // Adam's first step moves every element by about lr against the gradient's sign.
/// for x in p.get()?.to_vec::<f32>()? {
///     assert!((x - 0.9).abs() < 1e-5);
/// }
/// # Ok::<(), fsdp_core::FsdpError>(())
/// ```
pub type LocalAdamW = Local<AdamWRule>;

impl Local<AdamWRule> {
    /// AdamW over `params` with hyper-parameters `hp`.
    pub fn new(params: Vec<Parameter>, hp: AdamParams) -> LocalAdamW {
        Local::from_rule(params, AdamWRule { hyper: hp })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plain scalar AdamW step written out independently (PyTorch's formulas, f64 scalars).
    fn adamw_reference(p: f32, g: f32, m: f32, v: f32, t: u64, h: AdamParams) -> (f32, f32, f32) {
        let p = p * (1.0 - h.lr as f64 * h.weight_decay as f64) as f32;
        let m = m + (1.0 - h.betas.0 as f64) as f32 * (g - m);
        let v = h.betas.1 * v + (1.0 - h.betas.1 as f64) as f32 * (g * g);
        let bc1 = 1.0 - (h.betas.0 as f64).powf(t as f64);
        let bc2 = 1.0 - (h.betas.1 as f64).powf(t as f64);
        let denom = v.sqrt() / (bc2.sqrt() as f32) + h.eps;
        let p = p + (-(h.lr as f64) / bc1) as f32 * (m / denom);
        (p, m, v)
    }

    #[test]
    fn adamw_rule_matches_the_written_out_formula_bitwise() {
        let h = AdamParams {
            lr: 0.01,
            betas: (0.8, 0.95),
            eps: 1e-6,
            weight_decay: 0.1,
        };
        let rule = AdamWRule { hyper: h };
        let mut p: Vec<f32> = (0..7).map(|i| 0.3 * i as f32 - 1.0).collect();
        let mut m = vec![0f32; 7];
        let mut v = vec![0f32; 7];
        let (mut rp, mut rm, mut rv) = (p.clone(), m.clone(), v.clone());
        for t in 1..=4u64 {
            let g: Vec<f32> = (0..7)
                .map(|i| ((i * 3 + t as usize) % 5) as f32 - 2.0)
                .collect();
            AdamWRule::update(&rule.coeffs(t), &mut p, &g, &mut [&mut m, &mut v], t == 1).unwrap();
            for i in 0..7 {
                (rp[i], rm[i], rv[i]) = adamw_reference(rp[i], g[i], rm[i], rv[i], t, h);
            }
            assert_eq!(p, rp, "step {t}");
            assert_eq!(m, rm);
            assert_eq!(v, rv);
        }
    }

    #[test]
    fn adamw_first_step_moves_by_lr_against_the_gradient() {
        let h = AdamParams {
            weight_decay: 0.0,
            ..AdamParams::new(0.05)
        };
        let mut p = vec![1.0f32, -2.0, 0.5];
        let g = [3.0f32, -0.25, 1e-3];
        let (mut m, mut v) = (vec![0.0; 3], vec![0.0; 3]);
        let c = AdamCoeffs::new(h.lr, h.betas, h.eps, 0.0, 1);
        adamw_step(&c, &mut p, &g, &mut m, &mut v).unwrap();
        for (x, want) in p.iter().zip([0.95f32, -1.95, 0.45]) {
            assert!((x - want).abs() < 1e-5, "{x} vs {want}");
        }
    }

    #[test]
    fn hyper_parameters_are_checked() {
        let bad = AdamParams {
            betas: (1.0, 0.9),
            ..AdamParams::new(0.1)
        };
        assert!(matches!(
            bad.check("t"),
            Err(crate::FsdpError::InvalidArgument(_))
        ));
        let bad = AdamParams {
            eps: 0.0,
            ..AdamParams::new(0.1)
        };
        assert!(bad.check("t").is_err());
        assert!(AdamParams::new(f32::NAN).check("t").is_err());
        assert!(AdamParams::new(0.1).check("t").is_ok());
    }
}
