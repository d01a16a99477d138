//! Optimizer, gradient-clipping and grad-scaler kernels: the launch side of the "optimizer"
//! section of `kernels.cu` (CPU counterparts in [`kernels::optim`](crate::kernels::optim)).
//!
//! The elementwise updates (SGD, AdamW, LAMB's direction and apply, unscale) evaluate the CPU
//! kernels' operations in the same order without FMA, so they are expected to be bit-identical
//! to the CPU. Sums of squares are f64 blocked sums over a fixed tree (the number of partial
//! blocks is a function of the piece's length only), added piece by piece in launch order into
//! an f64 accumulator and rounded to f32 once: deterministic, no atomics, but summed in another
//! order than the CPU's sequential f64 loop, so they may differ from the CPU in the last f32 bit.

use fsdp_alloc::{BufferRef, Stream};

use super::context::{expect_len, CudaKernels, Elem};
use super::elementwise::{plan_map, sum_parts};
use super::error::Result;
use super::plan::{PArg, Plan, Ptr};
use super::program::Kernel;
use crate::kernels::optim::{AdamCoeffs, LambCoeffs, SgdRule, SqPiece};
use crate::kernels::KernelError;

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
                Kernel::OptSgdMomentum,
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
            Kernel::OptSgd,
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

/// One fused AdamW step over `n` elements (both moments at once).
pub(crate) fn plan_adamw(n: u64, c: &AdamCoeffs, p: Ptr, g: Ptr, m: Ptr, v: Ptr) -> Plan {
    plan_map(
        Kernel::OptAdamW,
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
        Kernel::OptLambDir,
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
        Kernel::OptLambApply,
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

/// Sums of squares of `pieces` — (address of the piece's first element, its length, output
/// index) — into `n_out` f32 outputs at `out`: an f64 accumulator (zeroed), per non-empty piece
/// a partial-sum launch and an accumulate launch (in order, one stream), then the rounding.
pub(crate) fn plan_sum_squares(pieces: &[(u64, u64, usize)], n_out: u64, out: Ptr) -> Plan {
    let mut plan = Plan::new();
    if n_out == 0 {
        return plan;
    }
    let acc = plan.scratch(n_out as usize, Elem::F64);
    plan.memset(Ptr::scratch(acc), 0, n_out as usize * 8);
    let max_parts = pieces
        .iter()
        .filter(|pc| pc.1 > 0)
        .map(|pc| sum_parts(pc.1))
        .max();
    if let Some(max_parts) = max_parts {
        // One partial-sum slot reused by every piece: the accumulate launch reads it before the
        // next piece's partial launch writes it (stream order).
        let partial = plan.scratch(max_parts as usize, Elem::F64);
        for &(addr, len, o) in pieces.iter().filter(|pc| pc.1 > 0) {
            let parts = sum_parts(len);
            plan.launch(
                Kernel::OptSumsqPartial,
                parts,
                vec![
                    PArg::U64(len),
                    PArg::Ptr(Ptr::Dev(addr)),
                    PArg::Ptr(Ptr::scratch(partial)),
                ],
            );
            plan.launch(
                Kernel::OptSumsqAccum,
                1,
                vec![
                    PArg::U64(parts as u64),
                    PArg::Ptr(Ptr::scratch(partial)),
                    PArg::Ptr(Ptr::Scratch {
                        slot: acc,
                        offset: o as u64 * 8,
                    }),
                ],
            );
        }
    }
    plan.launch(
        Kernel::OptSumsqFinal,
        super::context::grid_for(n_out),
        vec![
            PArg::U64(n_out),
            PArg::Ptr(Ptr::scratch(acc)),
            PArg::Ptr(out),
        ],
    );
    plan
}

/// Grad-scaler unscale of `n` elements.
pub(crate) fn plan_unscale(n: u64, inv: f32, g: Ptr, flag: Ptr) -> Plan {
    plan_map(
        Kernel::OptUnscale,
        n,
        vec![PArg::U64(n), PArg::F32(inv), PArg::Ptr(g), PArg::Ptr(flag)],
    )
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

    /// Deterministic sums of squares (CPU: the seam's `SumSquares` on the CPU, sequential f64):
    /// `out[o] = Σ` over the pieces naming `o`, in order, of the piece's f64 sum of squares,
    /// rounded to f32 once; outputs no piece names are 0.
    ///
    /// # Errors
    /// Pieces outside their input or the outputs, buffer/stream errors, `out` overlapping an
    /// input.
    pub fn sum_squares(
        &self,
        stream: &Stream,
        xs: &[BufferRef],
        pieces: &[SqPiece],
        out: &BufferRef,
    ) -> Result<()> {
        let op = "sum_squares";
        let c = self.call(op, stream)?;
        let [dout] = c.f32_bufs([("out", out)])?;
        let mut devs = Vec::with_capacity(xs.len());
        for x in xs {
            devs.push(c.buf("xs", x, Elem::F32)?);
            c.disjoint(&[("out", out)], &[("xs", x)])?;
        }
        let mut plan_pieces = Vec::with_capacity(pieces.len());
        for (i, pc) in pieces.iter().enumerate() {
            let bad = || {
                KernelError::InvalidShape {
                    op,
                    reason: format!("piece {i} ({pc:?}) reaches outside its input or the outputs"),
                }
                .into()
            };
            let d = devs.get(pc.input).ok_or_else(bad)?;
            if pc.start.checked_add(pc.len).is_none_or(|e| e > d.len) || pc.out >= dout.len {
                return Err(bad());
            }
            plan_pieces.push((d.ptr + pc.start as u64 * 4, pc.len as u64, pc.out));
        }
        let plan = plan_sum_squares(&plan_pieces, dout.len as u64, dout.as_ptr());
        // SAFETY: every piece lies inside its input (checked), out holds n_out f32 and overlaps
        // no input; scratch is sized by the plan.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// Grad-scaler unscale: `g *= inv`, `found_inf[0] = 1` where an element was inf or NaN
    /// (CPU: [`optim::unscale`](crate::kernels::optim::unscale)).
    ///
    /// # Errors
    /// A flag of another size than one element, buffer/stream errors, overlap.
    pub fn unscale(
        &self,
        stream: &Stream,
        inv: f32,
        g: &BufferRef,
        found_inf: &BufferRef,
    ) -> Result<()> {
        let op = "unscale";
        let c = self.call(op, stream)?;
        let [dg, df] = c.f32_bufs([("g", g), ("found_inf", found_inf)])?;
        expect_len(op, "found_inf", df.len, 1, || "a one-element flag".into())?;
        c.disjoint(&[("g", g), ("found_inf", found_inf)], &[])?;
        let plan = plan_unscale(dg.len as u64, inv, dg.as_ptr(), df.as_ptr());
        // SAFETY: g holds n f32 and the flag one, disjoint; each g element has one thread, the
        // flag is only ever set to 1.0.
        unsafe { c.exec(&plan) }.map(drop)
    }
}
