//! AdamW (PyTorch's single-tensor algorithm): the step's scalars ([`AdamCoeffs`]), the
//! host-slice kernel ([`adamw_step`]) and the fused op ([`AdamWStep`], both state slots at once).

use fsdp_alloc::Stream;

use super::common::{check_optim, f32_arg, par_pieces};
use crate::error::Result;
use crate::kernels::check::same_len;
use crate::kernels::cpu::math::{vectorized, SimdKernel};
use crate::kernels::op::{Check, Op};
use crate::kernels::operand::Operand;
use crate::kernels::KernelError;
use crate::launch::launch_f32;

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
pub(super) fn moments(g: f32, m: &mut f32, v: &mut f32, c: &AdamCoeffs) -> (f32, f32) {
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

/// Fused AdamW step of `n` elements, both state slots at once ([`adamw_step`]).
#[derive(Debug, Clone, Copy)]
pub struct AdamWStep<'a> {
    /// Elements.
    pub n: usize,
    /// The step's scalars.
    pub c: AdamCoeffs,
    /// Parameters (updated).
    pub p: &'a Operand,
    /// Gradient.
    pub g: &'a Operand,
    /// First moment (updated).
    pub m: &'a Operand,
    /// Second moment (updated).
    pub v: &'a Operand,
}

impl Op for AdamWStep<'_> {
    fn name(&self) -> &'static str {
        "adamw_step"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (n, p, g, m, v) = (self.n, self.p, self.g, self.m, self.v);
        let t = [
            f32_arg("p", p, n),
            f32_arg("g", g, n),
            f32_arg("m", m, n),
            f32_arg("v", v, n),
        ];
        check_optim(c, self.name(), n, &t, &[p, m, v])
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let (op, c) = (self.name(), self.c);
        let (p, g, m, v) = (self.p, self.g, self.m, self.v);
        launch_f32(s, op, [g], [p, m, v], true, move |[g], [p, m, v]| {
            par_pieces([g], [p, m, v], |[g], [p, m, v]| adamw_step(&c, p, g, m, v))
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::err;
        let (p, g, m, v) = (&self.p.buf, &self.g.buf, &self.m.buf, &self.v.buf);
        b.kernels()
            .adamw_step(s, &self.c, p, g, m, v)
            .map_err(err(self.name()))
    }
}

/// The CUDA side of the op (feature `cuda`): its kernels' declarations, launch plans and
/// [`CudaKernels`](crate::kernels::cuda::CudaKernels) methods.
#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use fsdp_alloc::{BufferRef, Stream};

    use crate::kernels::cuda::context::CudaKernels;
    use crate::kernels::cuda::error::Result;
    use crate::kernels::cuda::plan::{plan_map, PArg, Plan, Ptr};
    use crate::kernels::optim::AdamCoeffs;

    crate::kernels::cuda::kernel::declare_kernels! {
        OPT_ADAMW = "opt_adamw" [U64, F32, F32, F32, F32, F32, F32, F32, Ptr, Ptr, Ptr, Ptr];
    }

    /// One fused AdamW step over `n` elements (both moments at once).
    pub(crate) fn plan_adamw(n: u64, c: &AdamCoeffs, p: Ptr, g: Ptr, m: Ptr, v: Ptr) -> Plan {
        plan_map(
            OPT_ADAMW,
            n,
            vec![
                PArg::U64(n),
                PArg::F32(c.decay),
                PArg::F32(c.one_minus_beta1),
                PArg::F32(c.beta2),
                PArg::F32(c.one_minus_beta2),
                PArg::F32(c.neg_step_size),
                PArg::F32(c.bc2_sqrt),
                PArg::F32(c.eps),
                PArg::Ptr(p),
                PArg::Ptr(g),
                PArg::Ptr(m),
                PArg::Ptr(v),
            ],
        )
    }

    impl CudaKernels {
        /// One fused AdamW step (CPU: [`optim::adamw_step`](crate::kernels::optim::adamw_step)),
        /// both moments in the same launch; expected bit-identical.
        ///
        /// # Errors
        /// Length mismatches, buffer/stream errors, overlapping arguments.
        pub fn adamw_step(
            &self,
            stream: &Stream,
            coeffs: &AdamCoeffs,
            p: &BufferRef,
            g: &BufferRef,
            m: &BufferRef,
            v: &BufferRef,
        ) -> Result<()> {
            let op = "adamw_step";
            let c = self.call(op, stream)?;
            let n = p.len() / 4;
            let shape = || format!("len(p)={n}");
            let [dp, dg, dm, dv] =
                c.f32_sized([("p", p, n), ("g", g, n), ("m", m, n), ("v", v, n)], shape)?;
            c.disjoint(&[("p", p), ("m", m), ("v", v)], &[("g", g)])?;
            let plan = plan_adamw(
                n as u64,
                coeffs,
                dp.as_ptr(),
                dg.as_ptr(),
                dm.as_ptr(),
                dv.as_ptr(),
            );
            // SAFETY: four disjoint (outputs) device buffers of n f32 each on this device; one
            // thread per element.
            unsafe { c.exec(&plan) }.map(drop)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorized AdamW step equals the element-by-element formula bit for bit, at every
    /// instruction-set level.
    #[test]
    fn adamw_is_the_same_bits_at_every_level() {
        use crate::kernels::cpu::isa::forced;
        let mut seed = 31u32;
        let mut rnd = || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
        };
        let n = 1037;
        let p0: Vec<f32> = (0..n).map(|_| rnd()).collect();
        let g: Vec<f32> = (0..n).map(|_| rnd()).collect();
        let m0: Vec<f32> = (0..n).map(|_| rnd()).collect();
        let v0: Vec<f32> = (0..n).map(|_| rnd().abs()).collect();
        let c = AdamCoeffs::new(1e-3, (0.9, 0.999), 1e-8, 0.01, 3);
        let (mut pw, mut mw, mut vw) = (p0.clone(), m0.clone(), v0.clone());
        for i in 0..n {
            let decayed = pw[i] * c.decay;
            mw[i] += c.one_minus_beta1 * (g[i] - mw[i]);
            vw[i] = c.beta2 * vw[i] + c.one_minus_beta2 * (g[i] * g[i]);
            let denom = vw[i].sqrt() / c.bc2_sqrt + c.eps;
            pw[i] = decayed + c.neg_step_size * (mw[i] / denom);
        }
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
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
}
