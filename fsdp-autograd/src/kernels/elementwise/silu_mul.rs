//! SiLU·mul, the gate of a SwiGLU feed-forward (Llama's MLP): [`SiluMul`] and
//! [`SiluMulBackward`], fused (one pass reads the gate and the up projection and writes the
//! product), with their host-slice kernels [`silu_mul`] and [`silu_mul_backward`].
//!
//! `y = silu(gate) · up` with `silu(g) = g / (1 + e^(−g))` (PyTorch's `F.silu`, transformers'
//! `act_fn(gate_proj(x)) * up_proj(x)` with `hidden_act = "silu"`), computed in f32 and rounded
//! once to the output's dtype (PyTorch rounds the SiLU to a half dtype before the product). The
//! backward, from the forward inputs: with `σ = 1 / (1 + e^(−g))`,
//! `dgate = dy · up · (σ · (1 + g · (1 − σ)))` and `dup = dy · silu(g)`.
//!
//! The CPU and CUDA kernels write the same expressions in the same order (each product and sum
//! rounded on its own: the CUDA program is compiled without FMA contraction); they differ only
//! where CUDA's `expf` and the host's `exp` do (a few ulp).

use fsdp_alloc::Stream;

use crate::error::Result;
use crate::kernels::check;
use crate::kernels::op::{n_is, Check, Op, Spec};
use crate::kernels::operand::Operand;
use crate::kernels::KernelError;
use crate::launch::launch_f32;

/// `silu(g) = g / (1 + e^(−g))`.
fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

/// `y = silu(gate) · up`, elementwise.
///
/// # Errors
/// [`KernelError::LengthMismatch`] unless `up` and `y` have `gate`'s length.
pub fn silu_mul(gate: &[f32], up: &[f32], y: &mut [f32]) -> std::result::Result<(), KernelError> {
    const OP: &str = "silu_mul";
    let n = gate.len();
    let shape = || format!("n={n}");
    check::len(OP, "up", up.len(), n, shape)?;
    check::len(OP, "y", y.len(), n, shape)?;
    for ((y, &g), &u) in y.iter_mut().zip(gate).zip(up) {
        *y = silu(g) * u;
    }
    Ok(())
}

/// Gradient of [`silu_mul`] from the forward inputs: `dgate = dy · up · (σ · (1 + g·(1 − σ)))`,
/// `dup = dy · silu(g)`, with `σ = 1 / (1 + e^(−g))` (both overwritten).
///
/// # Errors
/// [`KernelError::LengthMismatch`] unless every slice has `gate`'s length.
pub fn silu_mul_backward(
    gate: &[f32],
    up: &[f32],
    dy: &[f32],
    dgate: &mut [f32],
    dup: &mut [f32],
) -> std::result::Result<(), KernelError> {
    const OP: &str = "silu_mul_backward";
    let n = gate.len();
    let shape = || format!("n={n}");
    check::len(OP, "up", up.len(), n, shape)?;
    check::len(OP, "dy", dy.len(), n, shape)?;
    check::len(OP, "dgate", dgate.len(), n, shape)?;
    check::len(OP, "dup", dup.len(), n, shape)?;
    let ins = gate.iter().zip(up).zip(dy);
    for (((&g, &u), &d), (dg, du)) in ins.zip(dgate.iter_mut().zip(dup.iter_mut())) {
        let e = (-g).exp();
        let sig = 1.0 / (1.0 + e);
        *dg = d * u * (sig * (1.0 + g * (1.0 - sig)));
        *du = d * (g / (1.0 + e));
    }
    Ok(())
}

/// SiLU·mul forward over `n` elements: `y = silu(gate) · up`.
#[derive(Debug, Clone, Copy)]
pub struct SiluMul<'a> {
    /// Elements.
    pub n: usize,
    /// The gate projection (SiLU's input).
    pub gate: &'a Operand,
    /// The up projection.
    pub up: &'a Operand,
    /// Output.
    pub y: &'a Operand,
}

impl Op for SiluMul<'_> {
    fn name(&self) -> &'static str {
        "silu_mul"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let n = self.n;
        let table = [
            Spec::float("gate", self.gate, n),
            Spec::float("up", self.up, n),
            Spec::float("y", self.y, n),
        ];
        c.args(self.name(), n_is(n), &table)?;
        Ok(n > 0)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let (ins, outs) = ([self.gate, self.up], [self.y]);
        launch_f32(s, "silu_mul", ins, outs, false, move |[g, u], [y]| {
            silu_mul(g, u, y)
        });
        Ok(())
    }

    /// The typed kernel (every operand f32, f16 or bf16, read and written directly).
    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::{err, tb};
        let [g, u, y] = [self.gate, self.up, self.y].map(tb);
        b.kernels().silu_mul_t(s, g, u, y).map_err(err("silu_mul"))
    }
}

/// SiLU·mul backward from the forward inputs; overwrites `dgate` and `dup`.
#[derive(Debug, Clone, Copy)]
pub struct SiluMulBackward<'a> {
    /// Elements.
    pub n: usize,
    /// The forward's gate.
    pub gate: &'a Operand,
    /// The forward's up projection.
    pub up: &'a Operand,
    /// Upstream gradient.
    pub dy: &'a Operand,
    /// Gradient of `gate`.
    pub dgate: &'a Operand,
    /// Gradient of `up`.
    pub dup: &'a Operand,
}

impl Op for SiluMulBackward<'_> {
    fn name(&self) -> &'static str {
        "silu_mul_backward"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let n = self.n;
        let table = [
            Spec::float("gate", self.gate, n),
            Spec::float("up", self.up, n),
            Spec::float("dy", self.dy, n),
            Spec::float("dgate", self.dgate, n),
            Spec::float("dup", self.dup, n),
        ];
        c.args(self.name(), n_is(n), &table)?;
        Ok(n > 0)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let (ins, outs) = ([self.gate, self.up, self.dy], [self.dgate, self.dup]);
        let op = "silu_mul_backward";
        launch_f32(s, op, ins, outs, false, move |[g, u, dy], [dg, du]| {
            silu_mul_backward(g, u, dy, dg, du)
        });
        Ok(())
    }

    /// The typed kernel (every operand f32, f16 or bf16, read and written directly).
    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::{err, tb};
        let [g, u, dy, dg, du] = [self.gate, self.up, self.dy, self.dgate, self.dup].map(tb);
        b.kernels()
            .silu_mul_backward_t(s, g, u, dy, dg, du)
            .map_err(err("silu_mul_backward"))
    }
}

/// The CUDA side of the op (feature `cuda`): its kernels' declarations, launch plans and
/// [`CudaKernels`](crate::kernels::cuda::CudaKernels) methods. One set of typed kernels serves
/// every dtype (all-f32 operands have the code word 0).
#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use fsdp_alloc::Stream;

    use crate::kernels::cuda::context::{expect_len, CudaKernels};
    use crate::kernels::cuda::error::Result;
    use crate::kernels::cuda::plan::{PArg, Plan, Ptr};
    use crate::kernels::cuda::typed::{operand, plan_map_t, types_word, TBuf};

    crate::kernels::cuda::kernel::declare_kernels! {
        SILU_MUL_FWD = "silu_mul_fwd_t" [U64, U64, Ptr, Ptr, Ptr];
        SILU_MUL_BWD = "silu_mul_bwd_t" [U64, U64, Ptr, Ptr, Ptr, Ptr, Ptr];
    }

    /// SiLU·mul forward; `p = [gate, up, y]`, `codes` the same order.
    pub(crate) fn plan_silu_mul(codes: [u64; 3], n: u64, p: [Ptr; 3]) -> Plan {
        let mut args = vec![PArg::U64(types_word(&codes)), PArg::U64(n)];
        args.extend(p.map(PArg::Ptr));
        plan_map_t(SILU_MUL_FWD, n, args)
    }

    /// SiLU·mul backward; `p = [gate, up, dy, dgate, dup]`, `codes` the same order.
    pub(crate) fn plan_silu_mul_backward(codes: [u64; 5], n: u64, p: [Ptr; 5]) -> Plan {
        let mut args = vec![PArg::U64(types_word(&codes)), PArg::U64(n)];
        args.extend(p.map(PArg::Ptr));
        plan_map_t(SILU_MUL_BWD, n, args)
    }

    impl CudaKernels {
        /// `y = silu(gate) · up` (CPU: [`silu_mul`](super::silu_mul)), each operand f32, f16 or
        /// bf16, computed in f32 and rounded once; CUDA's `expf` makes it differ from the CPU by
        /// a few ulp.
        ///
        /// # Errors
        /// Length mismatch; a non-float operand; buffer/stream errors; `y` overlapping an input.
        pub(crate) fn silu_mul_t(
            &self,
            stream: &Stream,
            gate: TBuf<'_>,
            up: TBuf<'_>,
            y: TBuf<'_>,
        ) -> Result<()> {
            let op = "silu_mul";
            let c = self.call(op, stream)?;
            let (bg, cg) = operand(&c, op, "gate", gate)?;
            let (bu, cu) = operand(&c, op, "up", up)?;
            let (by, cy) = operand(&c, op, "y", y)?;
            let shape = || format!("n={}", bg.len);
            expect_len(op, "up", bu.len, bg.len, shape)?;
            expect_len(op, "y", by.len, bg.len, shape)?;
            c.disjoint(&[("y", y.0)], &[("gate", gate.0), ("up", up.0)])?;
            let plan = plan_silu_mul(
                [cg, cu, cy],
                bg.len as u64,
                [bg, bu, by].map(|d| d.as_ptr()),
            );
            // SAFETY: gate, up and y hold n elements of their dtypes on this device; y overlaps
            // neither input; thread i writes y[i] only.
            unsafe { c.exec(&plan) }.map(drop)
        }

        /// Gradient of [`CudaKernels::silu_mul_t`] (CPU:
        /// [`silu_mul_backward`](super::silu_mul_backward)), each operand f32, f16 or bf16.
        ///
        /// # Errors
        /// As [`CudaKernels::silu_mul_t`]; an output overlapping any other argument.
        pub(crate) fn silu_mul_backward_t(
            &self,
            stream: &Stream,
            gate: TBuf<'_>,
            up: TBuf<'_>,
            dy: TBuf<'_>,
            dgate: TBuf<'_>,
            dup: TBuf<'_>,
        ) -> Result<()> {
            let op = "silu_mul_backward";
            let c = self.call(op, stream)?;
            let (bg, cg) = operand(&c, op, "gate", gate)?;
            let (bu, cu) = operand(&c, op, "up", up)?;
            let (bdy, cdy) = operand(&c, op, "dy", dy)?;
            let (bdg, cdg) = operand(&c, op, "dgate", dgate)?;
            let (bdu, cdu) = operand(&c, op, "dup", dup)?;
            let shape = || format!("n={}", bg.len);
            for (arg, len) in [
                ("up", bu.len),
                ("dy", bdy.len),
                ("dgate", bdg.len),
                ("dup", bdu.len),
            ] {
                expect_len(op, arg, len, bg.len, shape)?;
            }
            c.disjoint(
                &[("dgate", dgate.0), ("dup", dup.0)],
                &[("gate", gate.0), ("up", up.0), ("dy", dy.0)],
            )?;
            let plan = plan_silu_mul_backward(
                [cg, cu, cdy, cdg, cdu],
                bg.len as u64,
                [bg, bu, bdy, bdg, bdu].map(|d| d.as_ptr()),
            );
            // SAFETY: every operand holds n elements of its dtype on this device; the outputs
            // overlap nothing else; thread i writes element i of each output only.
            unsafe { c.exec(&plan) }.map(drop)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Forward and backward against the f64 definitions (and a central difference of the f64
    /// forward for the derivative), over the saturating ends too.
    #[test]
    fn forward_and_backward_match_the_f64_definition() {
        let gate: Vec<f32> = (0..401).map(|i| (i as f32 - 200.0) * 0.25).collect();
        let up: Vec<f32> = gate.iter().map(|g| 0.5 - 0.01 * g).collect();
        let dy: Vec<f32> = gate.iter().map(|g| 1.0 + 0.003 * g).collect();
        let mut y = vec![0.0; gate.len()];
        silu_mul(&gate, &up, &mut y).unwrap();
        let (mut dg, mut du) = (vec![f32::NAN; gate.len()], vec![f32::NAN; gate.len()]);
        silu_mul_backward(&gate, &up, &dy, &mut dg, &mut du).unwrap();
        let silu64 = |g: f64| g / (1.0 + (-g).exp());
        for i in 0..gate.len() {
            let (g, u, d) = (gate[i] as f64, up[i] as f64, dy[i] as f64);
            let want = silu64(g) * u;
            assert!(
                (y[i] as f64 - want).abs() <= 1e-6 * want.abs().max(1.0),
                "y[{i}]"
            );
            let h = 1e-4;
            let dsilu = (silu64(g + h) - silu64(g - h)) / (2.0 * h);
            let (wdg, wdu) = (d * u * dsilu, d * silu64(g));
            assert!(
                (dg[i] as f64 - wdg).abs() <= 1e-5 * wdg.abs().max(1.0),
                "dgate[{i}]"
            );
            assert!(
                (du[i] as f64 - wdu).abs() <= 1e-5 * wdu.abs().max(1.0),
                "dup[{i}]"
            );
        }
        // Large |g| saturates without NaN: silu(−100) = −0, silu'(±100) ∈ {0, 1}.
        assert!(y.iter().chain(&dg).chain(&du).all(|v| v.is_finite()));
    }

    #[test]
    fn mismatched_lengths_are_errors() {
        let mut y = vec![0.0; 3];
        let e = silu_mul(&[1.0; 3], &[1.0; 2], &mut y);
        assert!(
            matches!(e, Err(KernelError::LengthMismatch { arg: "up", .. })),
            "{e:?}"
        );
        let (mut a, mut b) = (vec![0.0; 3], vec![0.0; 4]);
        let e = silu_mul_backward(&[1.0; 3], &[1.0; 3], &[1.0; 3], &mut a, &mut b);
        assert!(
            matches!(e, Err(KernelError::LengthMismatch { arg: "dup", .. })),
            "{e:?}"
        );
    }
}
