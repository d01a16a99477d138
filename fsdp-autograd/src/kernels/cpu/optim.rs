//! Optimizer, gradient-clipping and grad-scaler kernels on flat f32 slices: the CPU kernels of
//! the seam's optimizer launches ([`Launch::SgdStep`](crate::kernels::backend::Launch::SgdStep),
//! `AdamWStep`, `LambDirection`, `LambApply`, `SumSquares`, `Unscale`) and the one place their
//! arithmetic is written down. fsdp-core's optimizer rules (`optim::Rule`) call these functions
//! as their host-slice update, and the CUDA kernels (`kernels.cu`, section "optimizer") repeat
//! the same operations in the same order.
//!
//! Every update is elementwise, one f32 rounding per operation, no fused multiply-add: running a
//! kernel on any piece of a tensor gives exactly that piece of the whole update, which is what
//! makes a sharded optimizer equal its local counterpart bit for bit. Norm sums accumulate in
//! f64, sequentially over each piece ([`sum_sq`]).

use super::math::{vectorized, SimdKernel};
use crate::kernels::check::same_len;
use crate::kernels::KernelError;

/// SGD's update (PyTorch's formulation, no dampening) of one flat tensor, element by element:
/// `d = g + λ·p`; with momentum `b = d` on the first step, else `b = μ·b + d`, then `d = b`
/// (Nesterov: `d = d + μ·b`); then `p = p + (−lr)·d`. Each operation rounds to f32 (no fused
/// multiply-add), so running it on any piece of a tensor gives exactly that piece of the whole
/// update.
///
/// ```
/// use fsdp_autograd::optim::SgdRule;
///
/// let rule = SgdRule::new(0.1).with_momentum(0.5);
/// let (mut p, mut b) = (vec![1.0f32], vec![0.0f32]);
/// rule.update(&mut p, &[2.0], Some(&mut b), true); // b = 2, p = 1 − 0.2
/// rule.update(&mut p, &[2.0], Some(&mut b), false); // b = 0.5·2 + 2 = 3, p −= 0.3
/// assert_eq!(b, [3.0]);
/// assert_eq!(p, [(1.0f32 + -0.1 * 2.0) + -0.1 * 3.0]);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdRule {
    /// Learning rate.
    pub lr: f32,
    /// Momentum factor μ (0 disables momentum and its buffer).
    pub momentum: f32,
    /// Weight decay λ (L2, added to the gradient).
    pub weight_decay: f32,
    /// Nesterov momentum (`d = d + μ·b` instead of `d = b`; only with momentum).
    pub nesterov: bool,
}

impl SgdRule {
    /// Plain SGD with learning rate `lr` (no momentum, no weight decay, no Nesterov).
    pub fn new(lr: f32) -> SgdRule {
        SgdRule {
            lr,
            momentum: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }

    /// With momentum μ.
    pub fn with_momentum(self, momentum: f32) -> SgdRule {
        SgdRule { momentum, ..self }
    }

    /// With weight decay λ.
    pub fn with_weight_decay(self, weight_decay: f32) -> SgdRule {
        SgdRule {
            weight_decay,
            ..self
        }
    }

    /// With or without Nesterov momentum.
    pub fn with_nesterov(self, nesterov: bool) -> SgdRule {
        SgdRule { nesterov, ..self }
    }

    /// Whether the rule keeps a momentum buffer.
    pub fn has_momentum(&self) -> bool {
        self.momentum != 0.0
    }

    /// Updates `p` in place from the gradient `g` (same length). `buf` is the momentum buffer
    /// (used only with momentum; `first` says it holds no history yet and is overwritten).
    /// Slices of unequal lengths are processed up to the shortest (use [`sgd_step`] for a
    /// checked call).
    pub fn update(&self, p: &mut [f32], g: &[f32], buf: Option<&mut [f32]>, first: bool) {
        let neg_lr = -self.lr;
        match buf.filter(|_| self.has_momentum()) {
            Some(b) => {
                for ((p, &g), b) in p.iter_mut().zip(g).zip(b.iter_mut()) {
                    let mut d = g;
                    if self.weight_decay != 0.0 {
                        d += self.weight_decay * *p;
                    }
                    *b = if first { d } else { self.momentum * *b + d };
                    let d = if self.nesterov {
                        d + self.momentum * *b
                    } else {
                        *b
                    };
                    *p += neg_lr * d;
                }
            }
            None => {
                for (p, &g) in p.iter_mut().zip(g) {
                    let mut d = g;
                    if self.weight_decay != 0.0 {
                        d += self.weight_decay * *p;
                    }
                    *p += neg_lr * d;
                }
            }
        }
    }
}

/// Checked [`SgdRule::update`]: `g` (and `buf`, if any) must have `p`'s length.
///
/// # Errors
/// [`KernelError::LengthMismatch`].
pub fn sgd_step(
    rule: &SgdRule,
    p: &mut [f32],
    g: &[f32],
    buf: Option<&mut [f32]>,
    first: bool,
) -> Result<(), KernelError> {
    same_len("sgd_step", "g", g.len(), "p", p.len())?;
    if let Some(b) = &buf {
        same_len("sgd_step", "buf", b.len(), "p", p.len())?;
    }
    rule.update(p, g, buf, first);
    Ok(())
}

/// AdamW's scalars for one step `t`, as the kernels see them (computed in f64 from the
/// hyper-parameters, rounded to f32 once).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamCoeffs {
    /// `1 − lr·λ` (decoupled weight decay).
    pub decay: f32,
    /// `1 − β1`.
    pub one_minus_beta1: f32,
    /// `β2`.
    pub beta2: f32,
    /// `1 − β2`.
    pub one_minus_beta2: f32,
    /// `−lr / (1 − β1ᵗ)`.
    pub neg_step_size: f32,
    /// `√(1 − β2ᵗ)`.
    pub bc2_sqrt: f32,
    /// ε.
    pub eps: f32,
}

impl AdamCoeffs {
    /// The scalars of step `step` (1 for the first) of AdamW with these hyper-parameters.
    pub fn new(lr: f32, betas: (f32, f32), eps: f32, weight_decay: f32, step: u64) -> AdamCoeffs {
        let (b1, b2) = (betas.0 as f64, betas.1 as f64);
        let t = step as f64;
        let bc1 = 1.0 - b1.powf(t);
        let bc2 = 1.0 - b2.powf(t);
        AdamCoeffs {
            decay: (1.0 - lr as f64 * weight_decay as f64) as f32,
            one_minus_beta1: (1.0 - b1) as f32,
            beta2: betas.1,
            one_minus_beta2: (1.0 - b2) as f32,
            neg_step_size: (-(lr as f64) / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            eps,
        }
    }
}

/// The Adam moment updates shared by AdamW and LAMB:
/// `m = m + (1−β1)·(g − m)`, `v = β2·v + (1−β2)·(g·g)`; returns the new (m, v).
#[inline(always)]
fn moments(g: f32, m: &mut f32, v: &mut f32, c: &AdamCoeffs) -> (f32, f32) {
    *m += c.one_minus_beta1 * (g - *m);
    *v = c.beta2 * *v + c.one_minus_beta2 * (g * g);
    (*m, *v)
}

/// One AdamW update (PyTorch's single-tensor algorithm), element by element, all state slots at
/// once: `p = p·(1 − lr·λ)`, the moments, `denom = √v / √(1−β2ᵗ) + ε`,
/// `p = p + (−lr/(1−β1ᵗ))·(m / denom)`.
///
/// # Errors
/// [`KernelError::LengthMismatch`] unless `g`, `m`, `v` have `p`'s length.
pub fn adamw_step(
    c: &AdamCoeffs,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "adamw_step";
    same_len(OP, "g", g.len(), "p", p.len())?;
    same_len(OP, "m", m.len(), "p", p.len())?;
    same_len(OP, "v", v.len(), "p", p.len())?;
    // At the CPU kernels' instruction-set level (AVX-512: 16 lanes): the operations are each
    // correctly rounded (no fused multiply-adds), so every level gives the same bits.
    struct Body<'a>(
        &'a AdamCoeffs,
        &'a mut [f32],
        &'a [f32],
        &'a mut [f32],
        &'a mut [f32],
    );
    impl SimdKernel for Body<'_> {
        type Output = ();
        #[inline(always)]
        fn run(self) {
            let Body(c, p, g, m, v) = self;
            for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                let decayed = *p * c.decay;
                let (m, v) = moments(g, m, v, c);
                let denom = v.sqrt() / c.bc2_sqrt + c.eps;
                *p = decayed + c.neg_step_size * (m / denom);
            }
        }
    }
    vectorized(Body(c, p, g, m, v));
    Ok(())
}

/// One LAMB step's scalars for the direction kernel.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LambCoeffs {
    /// The moment scalars (Adam's, with `lr = 0` and no weight decay).
    pub adam: AdamCoeffs,
    /// `1 − β1ᵗ`.
    pub bc1: f32,
    /// `1 − β2ᵗ`.
    pub bc2: f32,
    /// Weight decay λ (added to the direction).
    pub weight_decay: f32,
    /// Learning rate.
    pub lr: f32,
}

impl LambCoeffs {
    /// The scalars of step `step` (1 for the first).
    pub fn new(lr: f32, betas: (f32, f32), eps: f32, weight_decay: f32, step: u64) -> LambCoeffs {
        let t = step as f64;
        LambCoeffs {
            adam: AdamCoeffs::new(0.0, betas, eps, 0.0, step),
            bc1: (1.0 - (betas.0 as f64).powf(t)) as f32,
            bc2: (1.0 - (betas.1 as f64).powf(t)) as f32,
            weight_decay,
            lr,
        }
    }
}

/// LAMB phase 1, element by element: the moments as in AdamW, then the update direction
/// `u = m̂ / (√v̂ + ε) + λ·p` with `m̂ = m / (1−β1ᵗ)`, `v̂ = v / (1−β2ᵗ)` (written to `u`).
///
/// # Errors
/// [`KernelError::LengthMismatch`] unless `g`, `m`, `v`, `u` have `p`'s length.
pub fn lamb_direction(
    c: &LambCoeffs,
    p: &[f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    u: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "lamb_direction";
    for (arg, n) in [
        ("g", g.len()),
        ("m", m.len()),
        ("v", v.len()),
        ("u", u.len()),
    ] {
        same_len(OP, arg, n, "p", p.len())?;
    }
    for ((((&p, &g), m), v), u) in p
        .iter()
        .zip(g)
        .zip(m.iter_mut())
        .zip(v.iter_mut())
        .zip(u.iter_mut())
    {
        let (m, v) = moments(g, m, v, &c.adam);
        let m_hat = m / c.bc1;
        let v_hat = v / c.bc2;
        *u = m_hat / (v_hat.sqrt() + c.adam.eps) + c.weight_decay * p;
    }
    Ok(())
}

/// The trust ratio `‖w‖ / ‖u‖` from the squared norms (1 if either norm is 0 or not finite).
pub fn trust_ratio(w_sq: f64, u_sq: f64) -> f32 {
    let (w, u) = (w_sq.sqrt(), u_sq.sqrt());
    if w > 0.0 && u > 0.0 && w.is_finite() && u.is_finite() {
        (w / u) as f32
    } else {
        1.0
    }
}

/// LAMB phase 2, element by element: `p = p + (−lr·ratio)·u` with
/// `ratio = `[`trust_ratio`]`(w_sq, u_sq)`.
///
/// # Errors
/// [`KernelError::LengthMismatch`] unless `u` has `p`'s length.
pub fn lamb_apply(
    p: &mut [f32],
    u: &[f32],
    lr: f32,
    w_sq: f64,
    u_sq: f64,
) -> Result<(), KernelError> {
    same_len("lamb_apply", "u", u.len(), "p", p.len())?;
    let a = -(lr * trust_ratio(w_sq, u_sq));
    for (p, &u) in p.iter_mut().zip(u) {
        *p += a * u;
    }
    Ok(())
}

/// Σ x² accumulated in f64, sequentially.
pub fn sum_sq(x: &[f32]) -> f64 {
    x.iter().map(|&v| v as f64 * v as f64).sum()
}

/// `g ← g·inv` in place; true if any element was inf or NaN before scaling.
pub fn unscale(g: &mut [f32], inv: f32) -> bool {
    let mut found = false;
    for x in g {
        found |= !x.is_finite();
        *x *= inv;
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorized AdamW step equals the element-by-element formula bit for bit, at every
    /// instruction-set level.
    #[test]
    fn adamw_is_the_same_bits_at_every_level() {
        use crate::kernels::cpu::isa::forced;
        use crate::kernels::cpu::testutil::{bits, Rng};
        let mut rng = Rng::new(31);
        let n = 1037;
        let (p0, g, m0) = (rng.vec(n), rng.vec(n), rng.vec(n));
        let v0: Vec<f32> = rng.vec(n).iter().map(|x| x.abs()).collect();
        let c = AdamCoeffs::new(1e-3, (0.9, 0.999), 1e-8, 0.01, 3);
        let (mut pw, mut mw, mut vw) = (p0.clone(), m0.clone(), v0.clone());
        for i in 0..n {
            let decayed = pw[i] * c.decay;
            mw[i] += c.one_minus_beta1 * (g[i] - mw[i]);
            vw[i] = c.beta2 * vw[i] + c.one_minus_beta2 * (g[i] * g[i]);
            let denom = vw[i].sqrt() / c.bc2_sqrt + c.eps;
            pw[i] = decayed + c.neg_step_size * (mw[i] / denom);
        }
        for level in forced::available() {
            let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
            forced::with_simd(level, || adamw_step(&c, &mut p, &g, &mut m, &mut v)).unwrap();
            assert_eq!(bits(&p), bits(&pw), "p at {level}");
            assert_eq!(
                (bits(&m), bits(&v)),
                (bits(&mw), bits(&vw)),
                "moments at {level}"
            );
        }
    }

    #[test]
    fn sgd_nesterov_follows_pytorch() {
        // PyTorch: b = μ·b + g; g = g + μ·b; p −= lr·g.
        let rule = SgdRule::new(0.1).with_momentum(0.9).with_nesterov(true);
        let (mut p, mut b) = (vec![1.0f32], vec![0.0f32]);
        rule.update(&mut p, &[2.0], Some(&mut b), true);
        assert_eq!(b, [2.0]);
        assert_eq!(p, [1.0f32 + -0.1 * (2.0 + 0.9 * 2.0)]);
        let b1 = 0.9f32 * 2.0 + 1.0;
        let p1 = p[0] + -0.1 * (1.0 + 0.9 * b1);
        rule.update(&mut p, &[1.0], Some(&mut b), false);
        assert_eq!((b[0], p[0]), (b1, p1));
    }

    #[test]
    fn kernels_reject_mismatched_lengths() {
        let c = AdamCoeffs::new(0.1, (0.9, 0.999), 1e-8, 0.0, 1);
        let (mut p, mut m, mut v) = (vec![0.0; 3], vec![0.0; 3], vec![0.0; 2]);
        assert!(matches!(
            adamw_step(&c, &mut p, &[0.0; 3], &mut m, &mut v),
            Err(KernelError::LengthMismatch { arg: "v", .. })
        ));
        assert!(sgd_step(&SgdRule::new(0.1), &mut p, &[1.0; 2], None, false).is_err());
        assert!(lamb_apply(&mut p, &[0.0; 4], 0.1, 1.0, 1.0).is_err());
    }

    #[test]
    fn unscale_flags_inf_and_nan_and_trust_ratio_falls_back() {
        let mut g = vec![2.0, f32::NAN];
        assert!(unscale(&mut g, 0.5));
        assert_eq!(g[0], 1.0);
        assert!(!unscale(&mut [1.0, 2.0], 0.5));
        assert_eq!(trust_ratio(4.0, 1.0), 2.0);
        assert_eq!(trust_ratio(0.0, 1.0), 1.0);
        assert_eq!(trust_ratio(f64::INFINITY, 1.0), 1.0);
        assert_eq!(sum_sq(&[3.0, 4.0]), 25.0);
    }
}
