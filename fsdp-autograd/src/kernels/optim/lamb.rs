//! LAMB: the step's scalars ([`LambCoeffs`]), the host-slice kernels ([`lamb_direction`],
//! [`trust_ratio`], [`lamb_apply`]) and the two ops around the norm sums ([`LambDirection`],
//! then one [`SumSquares`](super::SumSquares), then [`LambApply`] with the trust ratio computed
//! on the device).

use fsdp_alloc::Stream;

use super::adamw::{moments, AdamCoeffs};
use super::common::{check_optim, f32_arg, par_pieces};
use crate::error::Result;
use crate::kernels::check::same_len;
use crate::kernels::op::{invalid, Check, Op};
use crate::kernels::operand::Operand;
use crate::kernels::KernelError;
use crate::launch::launch_f32;

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

/// LAMB's moments and direction `u` over `n` elements ([`lamb_direction`]).
#[derive(Debug, Clone, Copy)]
pub struct LambDirection<'a> {
    /// Elements.
    pub n: usize,
    /// The step's scalars.
    pub c: LambCoeffs,
    /// Parameters (read).
    pub p: &'a Operand,
    /// Gradient.
    pub g: &'a Operand,
    /// First moment (updated).
    pub m: &'a Operand,
    /// Second moment (updated).
    pub v: &'a Operand,
    /// Direction (written).
    pub u: &'a Operand,
}

impl Op for LambDirection<'_> {
    fn name(&self) -> &'static str {
        "lamb_direction"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (n, p, g, m, v, u) = (self.n, self.p, self.g, self.m, self.v, self.u);
        let t = [
            f32_arg("p", p, n),
            f32_arg("g", g, n),
            f32_arg("m", m, n),
            f32_arg("v", v, n),
            f32_arg("u", u, n),
        ];
        check_optim(c, self.name(), n, &t, &[m, v, u])
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let (op, c) = (self.name(), self.c);
        let (p, g, m, v, u) = (self.p, self.g, self.m, self.v, self.u);
        launch_f32(s, op, [p, g], [m, v, u], true, move |[p, g], [m, v, u]| {
            par_pieces([p, g], [m, v, u], |[p, g], [m, v, u]| {
                lamb_direction(&c, p, g, m, v, u)
            })
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::err;
        let (p, g, m) = (&self.p.buf, &self.g.buf, &self.m.buf);
        let (v, u) = (&self.v.buf, &self.u.buf);
        b.kernels()
            .lamb_direction(s, &self.c, p, g, m, v, u)
            .map_err(err(self.name()))
    }
}

/// `p += (−lr·ratio)·u` over `n` elements, the trust ratio computed on the device from the
/// squared norms `sums[w_sq]` and `sums[u_sq]` ([`lamb_apply`]).
#[derive(Debug, Clone, Copy)]
pub struct LambApply<'a> {
    /// Elements.
    pub n: usize,
    /// Learning rate.
    pub lr: f32,
    /// Index of `‖p‖²` in `sums`.
    pub w_sq: usize,
    /// Index of `‖u‖²` in `sums`.
    pub u_sq: usize,
    /// The squared norms.
    pub sums: &'a Operand,
    /// Direction.
    pub u: &'a Operand,
    /// Parameters (updated).
    pub p: &'a Operand,
}

impl Op for LambApply<'_> {
    fn name(&self) -> &'static str {
        "lamb_apply"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, n, sums) = (self.name(), self.n, self.sums);
        let (w_sq, u_sq) = (self.w_sq, self.u_sq);
        if w_sq >= sums.numel() || u_sq >= sums.numel() {
            let reason = format!(
                "norm indices {w_sq} and {u_sq} must lie below the {} sums",
                sums.numel()
            );
            return Err(invalid(op, reason));
        }
        let t = [
            f32_arg("u", self.u, n),
            f32_arg("p", self.p, n),
            f32_arg("sums", sums, sums.numel()),
        ];
        check_optim(c, op, n, &t, &[self.p])
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let (op, lr, w_sq, u_sq) = (self.name(), self.lr, self.w_sq, self.u_sq);
        let (sums, u, p) = (self.sums, self.u, self.p);
        launch_f32(s, op, [u, sums], [p], true, move |[u, sums], [p]| {
            let (w, un) = (sums[w_sq] as f64, sums[u_sq] as f64);
            par_pieces([u], [p], |[u], [p]| lamb_apply(p, u, lr, w, un))
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::err;
        let (sums, u, p) = (&self.sums.buf, &self.u.buf, &self.p.buf);
        b.kernels()
            .lamb_apply(s, self.lr, self.w_sq, self.u_sq, sums, u, p)
            .map_err(err(self.name()))
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
    use crate::kernels::optim::LambCoeffs;
    use crate::kernels::KernelError;

    crate::kernels::cuda::kernel::declare_kernels! {
        OPT_LAMB_DIR = "opt_lamb_dir" [U64, F32, F32, F32, F32, F32, F32, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
        OPT_LAMB_APPLY = "opt_lamb_apply" [U64, F32, U64, U64, Ptr, Ptr, Ptr];
    }

    /// LAMB's moments and direction over `n` elements.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn plan_lamb_direction(
        n: u64,
        c: &LambCoeffs,
        p: Ptr,
        g: Ptr,
        m: Ptr,
        v: Ptr,
        u: Ptr,
    ) -> Plan {
        let a = &c.adam;
        plan_map(
            OPT_LAMB_DIR,
            n,
            vec![
                PArg::U64(n),
                PArg::F32(a.one_minus_beta1),
                PArg::F32(a.beta2),
                PArg::F32(a.one_minus_beta2),
                PArg::F32(a.eps),
                PArg::F32(c.bc1),
                PArg::F32(c.bc2),
                PArg::F32(c.weight_decay),
                PArg::Ptr(p),
                PArg::Ptr(g),
                PArg::Ptr(m),
                PArg::Ptr(v),
                PArg::Ptr(u),
            ],
        )
    }

    /// LAMB's apply over `n` elements, the trust ratio from `sums[w_sq]`, `sums[u_sq]`.
    pub(crate) fn plan_lamb_apply(
        n: u64,
        lr: f32,
        w_sq: u64,
        u_sq: u64,
        sums: Ptr,
        u: Ptr,
        p: Ptr,
    ) -> Plan {
        plan_map(
            OPT_LAMB_APPLY,
            n,
            vec![
                PArg::U64(n),
                PArg::F32(lr),
                PArg::U64(w_sq),
                PArg::U64(u_sq),
                PArg::Ptr(sums),
                PArg::Ptr(u),
                PArg::Ptr(p),
            ],
        )
    }

    impl CudaKernels {
        /// LAMB's moments and direction (CPU:
        /// [`optim::lamb_direction`](crate::kernels::optim::lamb_direction)).
        ///
        /// # Errors
        /// Length mismatches, buffer/stream errors, overlapping arguments.
        #[allow(clippy::too_many_arguments)]
        pub fn lamb_direction(
            &self,
            stream: &Stream,
            coeffs: &LambCoeffs,
            p: &BufferRef,
            g: &BufferRef,
            m: &BufferRef,
            v: &BufferRef,
            u: &BufferRef,
        ) -> Result<()> {
            let op = "lamb_direction";
            let c = self.call(op, stream)?;
            let n = p.len() / 4;
            let shape = || format!("len(p)={n}");
            let [dp, dg, dm, dv, du] = c.f32_sized(
                [
                    ("p", p, n),
                    ("g", g, n),
                    ("m", m, n),
                    ("v", v, n),
                    ("u", u, n),
                ],
                shape,
            )?;
            c.disjoint(&[("m", m), ("v", v), ("u", u)], &[("p", p), ("g", g)])?;
            let plan = plan_lamb_direction(
                n as u64,
                coeffs,
                dp.as_ptr(),
                dg.as_ptr(),
                dm.as_ptr(),
                dv.as_ptr(),
                du.as_ptr(),
            );
            // SAFETY: five device buffers of n f32 each, outputs disjoint from everything; one
            // thread per element.
            unsafe { c.exec(&plan) }.map(drop)
        }

        /// LAMB's apply with the trust ratio computed on the device from `sums[w_sq]`, `sums[u_sq]`
        /// (CPU: [`optim::lamb_apply`](crate::kernels::optim::lamb_apply)).
        ///
        /// # Errors
        /// Length mismatches, indices outside `sums`, buffer/stream errors, `p` overlapping `u` or
        /// `sums`.
        #[allow(clippy::too_many_arguments)]
        pub fn lamb_apply(
            &self,
            stream: &Stream,
            lr: f32,
            w_sq: usize,
            u_sq: usize,
            sums: &BufferRef,
            u: &BufferRef,
            p: &BufferRef,
        ) -> Result<()> {
            let op = "lamb_apply";
            let c = self.call(op, stream)?;
            let [dp, du, ds] = c.f32_bufs([("p", p), ("u", u), ("sums", sums)])?;
            expect_len(op, "u", du.len, dp.len, || format!("len(p)={}", dp.len))?;
            if w_sq >= ds.len || u_sq >= ds.len {
                return Err(KernelError::InvalidShape {
                    op,
                    reason: format!(
                        "norm indices {w_sq} and {u_sq} must lie below the {} sums",
                        ds.len
                    ),
                }
                .into());
            }
            c.disjoint(&[("p", p)], &[("u", u), ("sums", sums)])?;
            let plan = plan_lamb_apply(
                dp.len as u64,
                lr,
                w_sq as u64,
                u_sq as u64,
                ds.as_ptr(),
                du.as_ptr(),
                dp.as_ptr(),
            );
            // SAFETY: p and u hold n f32, sums holds more than both indices; p overlaps neither.
            unsafe { c.exec(&plan) }.map(drop)
        }
    }
}
