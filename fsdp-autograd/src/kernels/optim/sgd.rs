//! SGD with momentum, weight decay and Nesterov: the rule ([`SgdRule`]), its host-slice kernel
//! ([`sgd_step`]) and the fused op ([`SgdStep`]).

use fsdp_alloc::Stream;

use super::common::{check_optim, f32_arg, par_pieces};
use crate::error::Result;
use crate::kernels::check::same_len;
use crate::kernels::op::{Check, Op};
use crate::kernels::operand::Operand;
use crate::kernels::KernelError;
use crate::launch::launch_f32;

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

/// Fused SGD step of `n` elements: [`SgdRule::update`] on `p` from `g` with the momentum
/// buffer `buf` (`None` without momentum; `first`: the buffer holds no history yet).
#[derive(Debug, Clone, Copy)]
pub struct SgdStep<'a> {
    /// Elements.
    pub n: usize,
    /// The hyper-parameters.
    pub rule: SgdRule,
    /// The momentum buffer is fresh (overwritten, not decayed).
    pub first: bool,
    /// Parameters (updated).
    pub p: &'a Operand,
    /// Gradient.
    pub g: &'a Operand,
    /// Momentum buffer (updated), with momentum only.
    pub buf: Option<&'a Operand>,
}

impl Op for SgdStep<'_> {
    fn name(&self) -> &'static str {
        "sgd_step"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (n, p, g) = (self.n, self.p, self.g);
        let mut t = vec![f32_arg("p", p, n), f32_arg("g", g, n)];
        let mut outs = vec![p];
        if let Some(b) = self.buf {
            t.push(f32_arg("buf", b, n));
            outs.push(b);
        }
        check_optim(c, self.name(), n, &t, &outs)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let (op, rule, first) = (self.name(), self.rule, self.first);
        let (p, g) = (self.p, self.g);
        match self.buf {
            Some(b) => launch_f32(s, op, [g], [p, b], true, move |[g], [p, b]| {
                par_pieces([g], [p, b], |[g], [p, b]| {
                    sgd_step(&rule, p, g, Some(b), first)
                })
            }),
            None => launch_f32(s, op, [g], [p], true, move |[g], [p]| {
                par_pieces([g], [p], |[g], [p]| sgd_step(&rule, p, g, None, first))
            }),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::err;
        let buf = self.buf.map(|b| &b.buf);
        b.kernels()
            .sgd_step(s, &self.rule, self.first, &self.p.buf, &self.g.buf, buf)
            .map_err(err(self.name()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}

/// The CUDA side of the op (feature `cuda`): its kernels' declarations, launch plans and
/// [`CudaKernels`](crate::kernels::cuda::CudaKernels) methods.
#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use fsdp_alloc::{BufferRef, Stream};

    use crate::kernels::cuda::context::{expect_len, CudaKernels};
    use crate::kernels::cuda::error::Result;
    use crate::kernels::cuda::plan::{plan_map, PArg, Plan, Ptr};
    use crate::kernels::optim::SgdRule;
    use crate::kernels::KernelError;

    crate::kernels::cuda::kernel::declare_kernels! {
        OPT_SGD = "opt_sgd" [U64, F32, F32, Ptr, Ptr];
        OPT_SGD_MOMENTUM = "opt_sgd_momentum" [U64, U64, F32, F32, F32, Ptr, Ptr, Ptr];
    }

    /// One SGD step over `n` elements (`buf`: the momentum buffer, with momentum only).
    pub(crate) fn plan_sgd(
        n: u64,
        rule: &SgdRule,
        first: bool,
        p: Ptr,
        g: Ptr,
        buf: Option<Ptr>,
    ) -> Plan {
        let neg_lr = -rule.lr;
        match buf.filter(|_| rule.has_momentum()) {
            Some(b) => {
                let flags = u64::from(first) | (u64::from(rule.nesterov) << 1);
                plan_map(
                    OPT_SGD_MOMENTUM,
                    n,
                    vec![
                        PArg::U64(n),
                        PArg::U64(flags),
                        PArg::F32(neg_lr),
                        PArg::F32(rule.momentum),
                        PArg::F32(rule.weight_decay),
                        PArg::Ptr(p),
                        PArg::Ptr(g),
                        PArg::Ptr(b),
                    ],
                )
            }
            None => plan_map(
                OPT_SGD,
                n,
                vec![
                    PArg::U64(n),
                    PArg::F32(neg_lr),
                    PArg::F32(rule.weight_decay),
                    PArg::Ptr(p),
                    PArg::Ptr(g),
                ],
            ),
        }
    }

    impl CudaKernels {
        /// One SGD step (CPU: [`optim::sgd_step`](crate::kernels::optim::sgd_step)),
        /// expected bit-identical. `buf` is the momentum buffer (required with momentum, ignored
        /// without); `first`: it holds no history yet.
        ///
        /// # Errors
        /// Length mismatches, buffer/stream errors, outputs (`p`, `buf`) overlapping other arguments,
        /// a missing buffer with momentum.
        pub fn sgd_step(
            &self,
            stream: &Stream,
            rule: &SgdRule,
            first: bool,
            p: &BufferRef,
            g: &BufferRef,
            buf: Option<&BufferRef>,
        ) -> Result<()> {
            let op = "sgd_step";
            let c = self.call(op, stream)?;
            let [dp, dg] = c.f32_bufs([("p", p), ("g", g)])?;
            let shape = || format!("len(p)={}", dp.len);
            expect_len(op, "g", dg.len, dp.len, shape)?;
            let buf = buf.filter(|_| rule.has_momentum());
            let db = match buf {
                Some(b) => {
                    let [db] = c.f32_bufs([("buf", b)])?;
                    expect_len(op, "buf", db.len, dp.len, shape)?;
                    c.disjoint(&[("p", p), ("buf", b)], &[("g", g)])?;
                    Some(db.as_ptr())
                }
                None if rule.has_momentum() => {
                    return Err(KernelError::InvalidShape {
                        op,
                        reason: "SGD with momentum needs a momentum buffer".into(),
                    }
                    .into())
                }
                None => {
                    c.disjoint(&[("p", p)], &[("g", g)])?;
                    None
                }
            };
            let plan = plan_sgd(dp.len as u64, rule, first, dp.as_ptr(), dg.as_ptr(), db);
            // SAFETY: p, g (and buf) hold n f32 each on this device, the outputs overlap nothing;
            // each element is read and written by one thread.
            unsafe { c.exec(&plan) }.map(drop)
        }
    }
}
