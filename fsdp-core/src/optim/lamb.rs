//! LAMB-style layer-wise adaptation: Adam moments, the direction `u = m̂/(√v̂ + ε) + λ·p` and a
//! per-original-parameter trust ratio `‖p‖ / ‖u‖`. [`LambRule`] is the rule on one whole
//! parameter ([`LocalLamb`] runs it); [`Lamb`] runs its two halves on shards with the norms
//! completed across ranks in between.

use std::ops::Range;

use fsdp_alloc::BufferRef;
use fsdp_autograd::{Parameter, Tensor};

use super::adamw::{moments, AdamCoeffs, AdamParams};
use super::driver::{state_operands, unit_operands, Local, Sharded, ShardedStep, UnitOperands};
use super::rule::Rule;
use crate::error::Result;
use crate::sharded::{all_reduce_sum, f32_mem, launch_f32, sum_sq, zeros_on, ShardedParams};

/// One LAMB step's coefficients. Made by [`Rule::coeffs`]; opaque.
#[derive(Clone, Copy, Debug)]
pub struct LambCoeffs {
    adam: AdamCoeffs,
    bc1: f32,
    bc2: f32,
    weight_decay: f32,
    lr: f32,
}

/// LAMB phase 1, element by element: moments as in AdamW, then the update direction
/// `u = m̂ / (√v̂ + ε) + λ·p` with `m̂ = m / (1−β1ᵗ)`, `v̂ = v / (1−β2ᵗ)` (written to `u`).
fn direction(p: &[f32], g: &[f32], m: &mut [f32], v: &mut [f32], u: &mut [f32], c: &LambCoeffs) {
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
}

/// LAMB phase 2, element by element: `p = p + (−lr·ratio)·u`.
fn apply(p: &mut [f32], u: &[f32], lr: f32, ratio: f32) {
    let a = -(lr * ratio);
    for (p, &u) in p.iter_mut().zip(u) {
        *p += a * u;
    }
}

/// The trust ratio `‖w‖ / ‖u‖` from the squared norms (1 if either norm is 0 or not finite).
pub(crate) fn trust_ratio(w_sq: f64, u_sq: f64) -> f32 {
    let (w, u) = (w_sq.sqrt(), u_sq.sqrt());
    if w > 0.0 && u > 0.0 && w.is_finite() && u.is_finite() {
        (w / u) as f32
    } else {
        1.0
    }
}

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
    const KERNEL: &'static str = "lamb";
    const SLOTS: &'static [&'static str] = &["exp_avg", "exp_avg_sq"];
    type Coeffs = LambCoeffs;

    fn check(&self, op: &str) -> Result<()> {
        self.hyper.check(op)
    }

    fn coeffs(&self, step: u64) -> LambCoeffs {
        let h = self.hyper;
        let t = step as f64;
        LambCoeffs {
            adam: AdamCoeffs::new(0.0, h.betas, h.eps, 0.0, step),
            bc1: (1.0 - (h.betas.0 as f64).powf(t)) as f32,
            bc2: (1.0 - (h.betas.1 as f64).powf(t)) as f32,
            weight_decay: h.weight_decay,
            lr: h.lr,
        }
    }

    fn update(c: &LambCoeffs, p: &mut [f32], g: &[f32], state: &mut [&mut [f32]], _: bool) {
        let [m, v] = state else {
            unreachable!("the drivers pass one slice per slot")
        };
        let mut u = vec![0f32; p.len()];
        direction(p, g, m, v, &mut u, c);
        let ratio = trust_ratio(sum_sq(p), sum_sq(&u));
        apply(p, &u, c.lr, ratio);
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
/// in the shard), the shard memory and the direction tensor.
struct Job {
    pieces: Vec<(usize, Range<usize>)>,
    param: BufferRef,
    dir: Tensor,
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
        let num_params: usize = shards.iter().map(|s| s.layout.num_params()).sum();
        // Phase 1: moments and directions, per unit with a gradient.
        let mut jobs: Vec<Job> = Vec::new();
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
            let (state, mut writes, _) =
                state_operands(&mut opt.slots, true, u, n, &dev, &stream, OP)?;
            let dir = zeros_on(n, &dev, &stream)?;
            writes.push(f32_mem(&dir, OP, "the LAMB direction", &stream)?);
            opt.slots.steps[u] += 1;
            let c = rule.coeffs(opt.slots.steps[u]);
            launch_f32(
                &stream,
                "lamb_direction",
                vec![param.clone(), grad],
                writes,
                move |r, w| {
                    let [m, v, d] = w else {
                        unreachable!("three outputs launched")
                    };
                    for range in &ranges {
                        direction(
                            &r[0][range.clone()],
                            &r[1][range.clone()],
                            &mut m[range.clone()],
                            &mut v[range.clone()],
                            &mut d[range.clone()],
                            &c,
                        );
                    }
                },
            );
            for t in &state {
                t.storage().bump_version();
            }
            jobs.push(Job { pieces, param, dir });
        }
        // Phase 2: per-parameter squared norms of p (first half) and u (second half), summed
        // over this rank's pieces in f64, then across the shard group in one all-reduce.
        let sums = zeros_on(2 * num_params, &dev, &stream)?;
        let mut reads = Vec::with_capacity(2 * jobs.len());
        for j in &jobs {
            reads.push(j.param.clone());
            reads.push(f32_mem(&j.dir, OP, "the LAMB direction", &stream)?);
        }
        let all_pieces: Vec<Vec<(usize, Range<usize>)>> =
            jobs.iter().map(|j| j.pieces.clone()).collect();
        launch_f32(
            &stream,
            "lamb_norms",
            reads,
            vec![f32_mem(&sums, OP, "the norm sums", &stream)?],
            move |r, w| {
                let mut acc = vec![0f64; 2 * num_params];
                for (j, pieces) in all_pieces.iter().enumerate() {
                    let (p, d) = (r[2 * j], r[2 * j + 1]);
                    for (idx, range) in pieces {
                        acc[*idx] += sum_sq(&p[range.clone()]);
                        acc[num_params + idx] += sum_sq(&d[range.clone()]);
                    }
                }
                for (o, a) in w[0].iter_mut().zip(&acc) {
                    *o = *a as f32;
                }
            },
        );
        if let Some(w) = all_reduce_sum(model, &sums, &stream)? {
            opt.pending.push(w);
        }
        // Phase 3: p += (−lr·ratio)·u per parameter piece, the ratios read on the stream.
        let sums_mem = f32_mem(&sums, OP, "the norm sums", &stream)?;
        let lr = rule.hyper.lr;
        for Job { pieces, param, dir } in jobs {
            launch_f32(
                &stream,
                "lamb_apply",
                vec![
                    f32_mem(&dir, OP, "the LAMB direction", &stream)?,
                    sums_mem.clone(),
                ],
                vec![param],
                move |r, w| {
                    let (d, sums) = (r[0], r[1]);
                    for (idx, range) in &pieces {
                        let ratio = trust_ratio(sums[*idx] as f64, sums[num_params + idx] as f64);
                        apply(&mut w[0][range.clone()], &d[range.clone()], lr, ratio);
                    }
                },
            );
        }
        for s in &shards {
            if s.grad.is_some() {
                s.shard.storage().bump_version();
            }
        }
        model.params_updated();
        Ok(())
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trust_ratio_falls_back_to_one() {
        assert_eq!(trust_ratio(4.0, 1.0), 2.0);
        assert_eq!(trust_ratio(0.0, 1.0), 1.0);
        assert_eq!(trust_ratio(1.0, 0.0), 1.0);
        assert_eq!(trust_ratio(f64::INFINITY, 1.0), 1.0);
    }
}
