//! What the optimizer ops share: the f32 argument table and its no-overlap check
//! ([`check_optim`]), and the split of an elementwise update over rayon's pool
//! ([`par_pieces`]).

use fsdp_alloc::DType;

use crate::error::{AutogradError, Result};
use crate::kernels::op::{n_is, Check, Spec};
use crate::kernels::operand::Operand;
use crate::kernels::KernelError;

/// What optimizer state, gradients and norm sums hold (for dtype errors).
const OPTIM: &str = "optimizer operands are f32";

/// An f32 optimizer operand of `n` elements.
pub(super) fn f32_arg<'a>(name: &'static str, o: &'a Operand, n: usize) -> Spec<'a> {
    Spec::exact(name, o, DType::F32, OPTIM, n)
}

/// The checks every optimizer op shares: every operand of `table` f32 of its stated size on the
/// device, and no output (`outs`, identified by their row in the table, so the same operand
/// passed under two names fails too; rows named `xs` are inputs) overlapping another operand.
/// `Ok(n > 0)`.
pub(super) fn check_optim(
    c: &Check,
    op: &'static str,
    n: usize,
    table: &[Spec<'_>],
    outs: &[&Operand],
) -> Result<bool> {
    c.args(op, n_is(n), table)?;
    let is_out = |a: &Spec<'_>| {
        outs.iter()
            .any(|o| std::ptr::eq(*o, a.operand()) && a.name() != "xs")
    };
    for (i, a) in table.iter().enumerate() {
        if !is_out(a) || a.operand().buf.is_empty() {
            continue;
        }
        for (j, b) in table.iter().enumerate() {
            if i != j && a.operand().buf.overlaps(&b.operand().buf) {
                return Err(AutogradError::Argument {
                    op,
                    detail: format!(
                        "the output `{}` overlaps `{}`; optimizer operands must be distinct \
                         memory",
                        a.name(),
                        b.name()
                    ),
                });
            }
        }
    }
    Ok(n > 0)
}

/// Elements per piece when an elementwise optimizer kernel is split across rayon's pool: 64 Ki
/// f32 (256 KiB per operand) is worth a task, and a GPT-2 unit's shard still makes dozens.
const PIECE: usize = 1 << 16;

/// One piece of [`par_pieces`]: the inputs' and outputs' slices of the same element range.
type Piece<'a, const I: usize, const O: usize> = ([&'a [f32]; I], [&'a mut [f32]; O]);

/// Runs `f` on matching pieces of `ins` and `outs` (operands of one length), on rayon's global
/// pool when there is more than one piece. For the elementwise kernels (SGD, AdamW, the LAMB
/// halves) a piece's update is exactly that piece of the whole update, so the result is the
/// same bit for bit however the work is split (the first error, if any, is returned).
pub(super) fn par_pieces<const I: usize, const O: usize>(
    ins: [&[f32]; I],
    outs: [&mut [f32]; O],
    f: impl Fn([&[f32]; I], [&mut [f32]; O]) -> std::result::Result<(), KernelError> + Sync,
) -> std::result::Result<(), KernelError> {
    use rayon::prelude::*;
    let n = outs.first().map_or(0, |o| o.len());
    let same = ins.iter().all(|x| x.len() == n) && outs.iter().all(|x| x.len() == n);
    if n <= PIECE || !same {
        // One piece, or operands the kernel itself must reject: run it whole.
        return f(ins, outs);
    }
    let mut out_pieces = outs.map(|o| o.chunks_mut(PIECE));
    let pieces: Vec<Piece<'_, I, O>> = (0..n.div_ceil(PIECE))
        .map(|k| {
            let r = k * PIECE..((k + 1) * PIECE).min(n);
            let o = out_pieces
                .each_mut()
                .map(|it| it.next().expect("every output has n elements"));
            (ins.map(|x| &x[r.clone()]), o)
        })
        .collect();
    pieces.into_par_iter().try_for_each(|(i, o)| f(i, o))
}

#[cfg(test)]
mod par_tests {
    use super::*;
    use crate::kernels::optim::{adamw_step, sgd_step, AdamCoeffs, SgdRule};

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Split over the pool or run whole, the elementwise optimizer kernels give the same bits.
    #[test]
    fn pieces_on_the_pool_equal_the_whole_update() {
        let n = 3 * PIECE + 17;
        let val = |k: usize, i: usize| ((i * 7 + k * 13) % 101) as f32 * 0.013 - 0.6;
        let g: Vec<f32> = (0..n).map(|i| val(1, i)).collect();
        let (p0, m0, v0): (Vec<f32>, Vec<f32>, Vec<f32>) = (
            (0..n).map(|i| val(2, i)).collect(),
            (0..n).map(|i| val(3, i) * 0.1).collect(),
            (0..n).map(|i| val(4, i).abs() * 0.01).collect(),
        );
        let c = AdamCoeffs::new(1e-3, (0.9, 0.95), 1e-8, 0.1, 3);
        let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
        adamw_step(&c, &mut p, &g, &mut m, &mut v).unwrap();
        let (mut pp, mut pm, mut pv) = (p0.clone(), m0.clone(), v0.clone());
        par_pieces([&g], [&mut pp, &mut pm, &mut pv], |[g], [p, m, v]| {
            adamw_step(&c, p, g, m, v)
        })
        .unwrap();
        assert_eq!(
            (bits(&pp), bits(&pm), bits(&pv)),
            (bits(&p), bits(&m), bits(&v))
        );

        let rule = SgdRule::new(0.1).with_momentum(0.9).with_nesterov(true);
        let (mut p, mut b) = (p0.clone(), m0.clone());
        sgd_step(&rule, &mut p, &g, Some(&mut b), false).unwrap();
        let (mut pp, mut pb) = (p0.clone(), m0.clone());
        par_pieces([&g], [&mut pp, &mut pb], |[g], [p, b]| {
            sgd_step(&rule, p, g, Some(b), false)
        })
        .unwrap();
        assert_eq!((bits(&pp), bits(&pb)), (bits(&p), bits(&b)));

        // Operands of different lengths reach the kernel whole, which rejects them.
        let mut short = vec![0f32; n - 1];
        let e = par_pieces([&g], [&mut short], |[g], [p]| {
            sgd_step(&rule, p, g, None, false)
        });
        assert!(
            matches!(e, Err(KernelError::LengthMismatch { .. })),
            "{e:?}"
        );
    }
}
