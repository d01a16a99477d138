//! LAMB-style layer-wise adaptation: Adam moments, the direction `u = m̂/(√v̂ + ε) + λ·p` and a
//! per-original-parameter trust ratio `‖p‖ / ‖u‖`. [`LambRule`] is the rule on one whole
//! parameter ([`LocalLamb`] runs it); [`Lamb`] runs its two halves on shards with the norms
//! completed across ranks in between.

use std::ops::Range;

use fsdp_autograd::kernels::optim::{
    lamb_apply, lamb_direction, sum_sq, LambApply, LambDirection, SqPiece, SumSquares,
};
use fsdp_autograd::kernels::{Kernels, Op, Operand};
use fsdp_autograd::{Parameter, Tensor};

use super::adamw::AdamParams;
use super::driver::{state_operands, unit_operands, Local, Sharded, ShardedStep, UnitOperands};
use super::rule::{kernel_err, missing_slices, slots, Rule, StepArgs};
use super::sharded::{
    all_reduce_sum, f32_operand, kernels_for, slice_f32, zeros_on, ShardedParams,
};
use crate::error::Result;

/// One LAMB step's scalars, as the kernels see them: the seam's type, made by
/// [`Rule::coeffs`].
pub use fsdp_autograd::kernels::optim::LambCoeffs;

/// LAMB's update rule on one whole parameter (slots `exp_avg`, `exp_avg_sq`): direction, f64
/// norms of `p` and `u`, trust ratio, update. Not an [`super::ElementwiseRule`]: the ratio needs
/// the whole parameter, so the sharded [`Lamb`] drives the two halves itself.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LambRule {
    /// Hyper-parameters.
    pub hyper: AdamParams,
}

impl Rule for LambRule {
    const NAME: &'static str = "Lamb";
    const TITLE: &'static str = "LAMB";
    const KERNEL: &'static str = "lamb";
    const SLOTS: &'static [&'static str] = &["exp_avg", "exp_avg_sq"];
    type Coeffs = LambCoeffs;

    fn check(&self, op: &str) -> Result<()> {
        self.hyper.check(op)
    }

    fn coeffs(&self, step: u64) -> LambCoeffs {
        let h = self.hyper;
        LambCoeffs::new(h.lr, h.betas, h.eps, h.weight_decay, step)
    }

    fn lr(&self) -> f32 {
        self.hyper.lr
    }

    fn set_lr(&mut self, lr: f32) {
        self.hyper.lr = lr;
    }

    fn update(
        c: &LambCoeffs,
        p: &mut [f32],
        g: &[f32],
        state: &mut [&mut [f32]],
        _: bool,
    ) -> Result<()> {
        let n = state.len();
        let [m, v] = state else {
            return Err(missing_slices("Lamb", n, 2));
        };
        let mut u = vec![0f32; p.len()];
        lamb_direction(c, p, g, m, v, &mut u).map_err(kernel_err)?;
        // The squared norms are rounded to f32 as the seam's `SumSquares` does (and the sharded
        // step, whose sums travel through an f32 all-reduce).
        let (w_sq, u_sq) = (sum_sq(p) as f32, sum_sq(&u) as f32);
        lamb_apply(p, &u, c.lr, w_sq as f64, u_sq as f64).map_err(kernel_err)
    }

    fn launch(c: &LambCoeffs, a: &StepArgs<'_>) -> Result<()> {
        let [m, v] = slots::<2>("Lamb::step", a)?;
        let n = a.p.numel();
        let u = zeros_on(n, a.device, a.stream)?;
        let sums = zeros_on(2, a.device, a.stream)?;
        let (uo, so) = (
            f32_operand(&u, "Lamb::step", "the LAMB direction", a.stream)?,
            f32_operand(&sums, "Lamb::step", "the norm sums", a.stream)?,
        );
        let (k, s) = (a.kernels, a.stream);
        k.launch(
            s,
            &LambDirection {
                n,
                c: *c,
                p: a.p,
                g: a.g,
                m,
                v,
                u: &uo,
            },
        )?;
        let xs = [a.p.clone(), uo.clone()];
        let pieces = [
            SqPiece {
                input: 0,
                start: 0,
                len: n,
                out: 0,
            },
            SqPiece {
                input: 1,
                start: 0,
                len: n,
                out: 1,
            },
        ];
        k.launch(
            s,
            &SumSquares {
                xs: &xs,
                pieces: &pieces,
                out: &so,
            },
        )?;
        k.launch(
            s,
            &LambApply {
                n,
                lr: c.lr,
                w_sq: 0,
                u_sq: 1,
                sums: &so,
                u: &uo,
                p: a.p,
            },
        )?;
        Ok(())
    }
}

/// Sharded LAMB-style optimizer: Adam moments, the direction `u = m̂/(√v̂ + ε) + λ·p`, and a
/// **per-original-parameter** trust ratio `‖p‖ / ‖u‖` (1 if either is 0), `p −= lr·ratio·u`.
///
/// The norms are exact per original parameter although parameters are split across ranks: each
/// rank sums squares of its pieces of `p` and `u` (the layout's per-rank pieces) and one
/// all-reduce of a vector of 2 × (number of parameters) f32 sums over the shard group completes
/// them (the mechanism of [`crate::clip::grad_norms_per_param`]). Everything runs on the
/// optimizer stream — the ratios never visit the host. One temporary of `chunk_numel` per unit
/// holds `u` during the step.
///
/// Compared with [`LocalLamb`], only the trust ratios differ, by the rounding of the norm sums
/// (f64 per rank, rounded to f32, summed in rank order in f32), a relative 1e-7-scale difference.
/// `opt.hyper` holds the hyper-parameters.
pub type Lamb = Sharded<LambRule>;

impl Sharded<LambRule> {
    /// LAMB with hyper-parameters `hp`.
    pub fn new(hp: AdamParams) -> Lamb {
        Sharded::from_rule(LambRule { hyper: hp })
    }
}

/// A unit's part of a sharded LAMB step: its trainable pieces as (global parameter index, range
/// in the shard), the shard and the direction.
struct Job {
    pieces: Vec<(usize, Range<usize>)>,
    param: Operand,
    dir: Operand,
}

impl ShardedStep for LambRule {
    fn sharded_step(opt: &mut Lamb, model: &dyn ShardedParams) -> Result<()> {
        const OP: &str = "Lamb::step";
        let rule = opt.rule;
        rule.check(OP)?;
        let shards = model.shards();
        opt.slots.ensure(shards.len(), OP)?;
        let stream = model.optimizer_stream().clone();
        let dev = model.shard_device().clone();
        let k = kernels_for(&dev)?;
        let num_params: usize = shards.iter().map(|s| s.layout.num_params()).sum();
        // Phase 1: moments and directions, per unit with a gradient, per trainable range.
        let mut jobs: Vec<Job> = Vec::new();
        let mut keep: Vec<Tensor> = Vec::new();
        let mut base = 0;
        for (u, s) in shards.iter().enumerate() {
            let first_param = base;
            base += s.layout.num_params();
            let Some(UnitOperands {
                ranges,
                param,
                grad,
                ..
            }) = unit_operands(s, OP, &stream)?
            else {
                continue;
            };
            let pieces: Vec<(usize, Range<usize>)> = s
                .layout
                .rank_pieces(s.rank)?
                .into_iter()
                .filter(|p| s.requires_grad[p.param_index])
                .map(|p| (first_param + p.param_index, p.shard_range()))
                .collect();
            let n = s.shard.numel();
            let (state, mems, _) = state_operands(&mut opt.slots, true, u, n, &dev, &stream, OP)?;
            let dir_t = zeros_on(n, &dev, &stream)?;
            let dir = f32_operand(&dir_t, OP, "the LAMB direction", &stream)?;
            opt.slots.steps[u] += 1;
            let c = rule.coeffs(opt.slots.steps[u]);
            for r in &ranges {
                let sl = |o: &Operand| slice_f32(o, r.clone());
                let (p, g, m, v, d) = (
                    sl(&param)?,
                    sl(&grad)?,
                    sl(&mems[0])?,
                    sl(&mems[1])?,
                    sl(&dir)?,
                );
                let l = LambDirection {
                    n: r.len(),
                    c,
                    p: &p,
                    g: &g,
                    m: &m,
                    v: &v,
                    u: &d,
                };
                k.launch(&stream, &l)?;
            }
            for t in &state {
                t.storage().bump_version();
            }
            keep.push(dir_t);
            jobs.push(Job { pieces, param, dir });
        }
        // Phase 2: per-parameter squared norms of p (first half) and u (second half), each a
        // sequential f64 sum over this rank's piece rounded to f32 (CUDA: a fixed blocked f64
        // sum), then across the shard group in one all-reduce.
        let sums = zeros_on(2 * num_params, &dev, &stream)?;
        let sums_op = f32_operand(&sums, OP, "the norm sums", &stream)?;
        let mut xs = Vec::with_capacity(2 * jobs.len());
        let mut sq = Vec::new();
        for (j, job) in jobs.iter().enumerate() {
            xs.push(job.param.clone());
            xs.push(job.dir.clone());
            for (idx, range) in &job.pieces {
                for (input, out) in [(2 * j, *idx), (2 * j + 1, num_params + idx)] {
                    sq.push(SqPiece {
                        input,
                        start: range.start,
                        len: range.len(),
                        out,
                    });
                }
            }
        }
        let l = SumSquares {
            xs: &xs,
            pieces: &sq,
            out: &sums_op,
        };
        launch_sums(&k, &stream, &l, 2 * num_params)?;
        if let Some(w) = all_reduce_sum(model, &sums, &stream)? {
            opt.pending.push(w);
        }
        // Phase 3: p += (−lr·ratio)·u per parameter piece, the ratios computed on the device.
        let lr = rule.hyper.lr;
        for Job { pieces, param, dir } in &jobs {
            for (idx, range) in pieces {
                let (p, d) = (
                    slice_f32(param, range.clone())?,
                    slice_f32(dir, range.clone())?,
                );
                let l = LambApply {
                    n: range.len(),
                    lr,
                    w_sq: *idx,
                    u_sq: num_params + idx,
                    sums: &sums_op,
                    u: &d,
                    p: &p,
                };
                k.launch(&stream, &l)?;
            }
        }
        drop(keep);
        for s in &shards {
            if s.grad.is_some() {
                s.shard.storage().bump_version();
            }
        }
        model.params_updated();
        Ok(())
    }
}

/// Launches a `SumSquares` into `n_out` sums (nothing to launch for none).
fn launch_sums(k: &Kernels, stream: &fsdp_alloc::Stream, l: &dyn Op, n_out: usize) -> Result<()> {
    if n_out > 0 {
        k.launch(stream, l)?;
    }
    Ok(())
}

/// Local LAMB-style optimizer with [`Lamb`]'s elementwise arithmetic; the norms are summed over
/// each whole parameter in f64. `opt.hyper` holds the hyper-parameters.
///
/// ```
/// use fsdp_alloc::{DType, Device};
/// use fsdp_autograd::{init::InitOp, InitContext};
/// use fsdp_core::optim::{AdamParams, LocalLamb, LocalOptimizer};
///
/// let dev = Device::cpu(0);
/// let p = InitContext::eager(&dev, 0).param("w", &[4], DType::F32, vec![InitOp::Fill(2.0)])?;
/// let hp = AdamParams { weight_decay: 0.0, ..AdamParams::new(0.1) };
/// let mut opt = LocalLamb::new(vec![p.clone()], hp);
/// p.get()?.sum()?.backward()?;
/// opt.step()?;
/// // u ≈ 1 everywhere, ‖p‖ = 4, ‖u‖ ≈ 2: ratio ≈ 2, so p ≈ 2 − 0.1·2.
/// for x in p.get()?.to_vec::<f32>()? {
///     assert!((x - 1.8).abs() < 1e-5);
/// }
/// # Ok::<(), fsdp_core::FsdpError>(())
/// ```
pub type LocalLamb = Local<LambRule>;

impl Local<LambRule> {
    /// LAMB over `params` with hyper-parameters `hp`.
    pub fn new(params: Vec<Parameter>, hp: AdamParams) -> LocalLamb {
        Local::from_rule(params, LambRule { hyper: hp })
    }
}
